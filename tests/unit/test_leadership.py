"""The election (app/runtime/leadership.py) with a fake clock: electors compete
for one lease on a real SQLite file, a standby waits while the leader renews
and takes over once its lease lapses, a leader stops trusting itself before its
lease's expiry, and a lost lease is told once."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy
from sqlalchemy.engine import Engine

from app.runtime.leadership import POLLS_PER_TTL, TRUST_MARGIN, Leadership
from app.store import lease as lease_store
from app.store.engine import open_database
from app.store.lease import Holder, LeaseHeld, LeaseLost, LeaseRow

NOW = 1_800_000_000.0
TTL = 15.0


class FakeTime:
    """One clock for every elector; `sleep` moves it on, and runs `during` (what
    the other electors do meanwhile) first."""

    def __init__(self) -> None:
        self.now = NOW
        self.during: Callable[[float], Awaitable[None]] | None = None

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        if self.during is not None:
            await self.during(self.now + seconds)
        self.now += seconds


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = open_database(tmp_path / "gpulane.db")
    yield engine
    engine.dispose()


def elector(
    engine: Engine,
    time: FakeTime,
    pid: int,
    alive: Callable[[LeaseRow], bool | None] = lambda row: True,
) -> Leadership:
    holder = Holder(pid=pid, host="h", listen=f"127.0.0.1:{8000 + pid}", name=f"h:{pid}")
    return Leadership(engine, holder, ttl=TTL, clock=time.clock, sleep=time.sleep, alive=alive)


def current(engine: Engine) -> LeaseRow:
    row = lease_store.peek(engine)
    assert row is not None
    return row


def test_competing_electors_one_leads_the_other_names_it(engine: Engine) -> None:
    time = FakeTime()
    a, b = elector(engine, time, 1), elector(engine, time, 2)
    assert a.take().term == 1
    with pytest.raises(LeaseHeld, match="127.0.0.1:8001") as held:
        b.take()
    assert "--standby" in str(held.value)
    assert b.lease is None and b.leader is not None and b.leader.pid == 1
    assert a.trusted() and not b.trusted()
    assert b.retry_after() == TTL


async def test_a_standby_waits_while_the_leader_renews_and_takes_over_once_it_stops(
    engine: Engine,
) -> None:
    time = FakeTime()
    leader, standby = elector(engine, time, 1), elector(engine, time, 2)
    leader.take()
    renewing = [True]
    next_renewal = [NOW + leader.every]

    async def meanwhile(until: float) -> None:
        # The leader renews on time while `renewing`, as its keep() would.
        while renewing[0] and next_renewal[0] <= until:
            time.now = next_renewal[0]
            assert await leader.renew_once()
            next_renewal[0] += leader.every
        if time.now >= NOW + 5 * TTL:
            renewing[0] = False  # the leader dies: no renewal after this

    time.during = meanwhile
    lease = await standby.wait_to_lead()
    stopped = next_renewal[0] - leader.every  # the last renewal
    assert lease.term == 2 and lease.previous_ended == "expired"
    # Not a moment before the lease lapsed, and at the first poll after it.
    assert stopped + TTL <= lease.acquired_at < stopped + TTL + standby.poll
    assert standby.poll == TTL / POLLS_PER_TTL
    assert standby.trusted() and not leader.trusted()


async def test_a_leader_gone_from_this_host_is_taken_over_at_the_next_poll(
    engine: Engine,
) -> None:
    time = FakeTime()
    elector(engine, time, 1).take()
    standby = elector(engine, time, 2, alive=lambda row: False)
    lease = await standby.wait_to_lead()
    assert lease.term == 2 and lease.previous_ended == "gone"
    assert lease.acquired_at == NOW  # its first read


async def test_a_released_lease_is_taken_at_the_next_poll(engine: Engine) -> None:
    time = FakeTime()
    leader, standby = elector(engine, time, 1), elector(engine, time, 2)
    leader.take()

    async def meanwhile(until: float) -> None:
        if standby.leader is not None and not current(engine).released:
            time.now += 1
            await leader.release()  # a clean stop while the standby waits

    time.during = meanwhile
    lease = await standby.wait_to_lead()
    assert lease.previous_ended == "released"
    assert lease.acquired_at == NOW + 1 + standby.poll


async def test_trust_ends_before_the_lease_and_a_renewal_restores_it_once(engine: Engine) -> None:
    time = FakeTime()
    leader = elector(engine, time, 1)
    renewed: list[float] = []
    leader.on_renewed = lambda: renewed.append(time.now)
    lease = leader.take()
    time.now = lease.expires_at - TRUST_MARGIN * TTL - 0.001
    assert leader.trusted()
    assert await leader.renew_once()
    assert renewed == []  # it was trusted: nothing to resume
    time.now = leader.lease.expires_at - TRUST_MARGIN * TTL  # type: ignore[union-attr]
    assert not leader.trusted()  # paused this long: it dispatches nothing
    assert await leader.renew_once()  # nobody took over meanwhile: the same term goes on
    assert leader.trusted() and renewed == [time.now]
    assert current(engine).term == 1


async def test_a_failed_renewal_says_when_the_lease_lapses_never_a_negative_time(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    time = FakeTime()
    leader = elector(engine, time, 1)
    lease = leader.take()

    def full(*args: object, **kwargs: object) -> None:
        raise sqlalchemy.exc.OperationalError("UPDATE", {}, Exception("database or disk is full"))

    monkeypatch.setattr("app.runtime.leadership.renew", full)
    with caplog.at_level(logging.WARNING, logger="gpulane.lease"):
        time.now = lease.expires_at - 10
        assert await leader.renew_once()
        time.now = lease.expires_at + 25
        assert await leader.renew_once()
    before, after = (r.getMessage() for r in caplog.records)
    assert "it lapses in 10 s unless a renewal succeeds" in before
    assert "it lapsed 25 s ago" in after and "-25" not in after


async def test_a_lost_lease_is_told_once_and_fences_every_write(engine: Engine) -> None:
    time = FakeTime()
    old, new = elector(engine, time, 1), elector(engine, time, 2)
    lost: list[str] = []
    old.on_lost = lost.append
    old.take()
    time.now += TTL  # frozen past its lease
    new.take()
    assert not old.trusted()
    assert not await old.renew_once()
    assert not await old.renew_once()
    assert len(lost) == 1 and "pid 2" in lost[0] and old.lost == lost[0]
    with engine.begin() as conn:
        with pytest.raises(LeaseLost):
            old.fence(conn)
        new.fence(conn)
    await old.release()  # not its lease any more: nothing changes
    assert current(engine).pid == 2 and not current(engine).released


def test_a_standby_writes_nothing(engine: Engine) -> None:
    time = FakeTime()
    standby = elector(engine, time, 2)
    with engine.begin() as conn, pytest.raises(LeaseLost, match="standby"):
        standby.fence(conn)
