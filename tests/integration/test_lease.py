"""The server lease (app/store/lease.py) on real SQLite files: competing servers,
expiry, a dead holder, a copy of the file, and a holder fenced by a take-over."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from app.core import events as ev
from app.core.scoring import ScoringParams
from app.runtime.leadership import Leadership
from app.store import lease as lease_store
from app.store.engine import open_database
from app.store.event_store import SqliteEventStore
from app.store.invariants import audit
from app.store.lease import (
    LEASE_TTL_S,
    Holder,
    LeaseHeld,
    LeaseLost,
    LeaseRow,
    acquire,
    database_id,
    holder_alive,
    holder_name,
    holds,
    process_start,
    release,
    renew,
    this_process,
)
from app.store.tables import READ_MODELS
from tests.integration.conftest import BACKENDS
from tests.waiting import wait_until
from tools.replay.generate import film, generate_events
from tools.replay.verify import verify

NOW = 1_800_000_000.0
HOST = socket.gethostname()


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = open_database(tmp_path / "gpulane.db")
    yield engine
    engine.dispose()


def holder(pid: int, listen: str = "127.0.0.1:8080", host: str = HOST) -> Holder:
    return Holder(pid=pid, host=host, listen=listen, name=f"test:{host}:{pid}:{listen}")


def always(answer: bool | None) -> Callable[[LeaseRow], bool | None]:
    """An `alive` that gives the same answer for every holder."""
    return lambda row: answer


def row(engine: Engine) -> LeaseRow | None:
    with engine.connect() as conn:
        return lease_store.read(conn)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process of ours whose pid can hold a lease."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def holder_of(engine: Engine, pid: int, listen: str = "127.0.0.1:8080") -> Holder:
    """What `this_process` would be for PID."""
    return Holder(
        pid, HOST, listen, holder_name(HOST, pid, process_start(pid), database_id(engine))
    )


# -- acquire ---------------------------------------------------------------------------


def test_the_first_server_of_a_database_takes_term_1(engine: Engine) -> None:
    me = this_process(engine, "127.0.0.1:9000")
    lease = acquire(engine, me, NOW)
    assert (lease.term, lease.previous, lease.previous_ended) == (1, None, None)
    assert row(engine) == LeaseRow(
        term=1,
        holder=me.name,
        pid=os.getpid(),
        host=HOST,
        listen="127.0.0.1:9000",
        acquired_at=NOW,
        renewed_at=NOW,
        expires_at=NOW + LEASE_TTL_S,
    )
    assert lease.event(7) == ev.LeaseAcquired(
        at=7, term=1, pid=os.getpid(), host=HOST, listen="127.0.0.1:9000"
    )


def test_a_live_holder_refuses_a_second_server_and_nothing_changes(
    engine: Engine, sleeper: subprocess.Popen[bytes]
) -> None:
    first = acquire(engine, holder_of(engine, sleeper.pid, "127.0.0.1:8123"), NOW)
    before = row(engine)
    with pytest.raises(LeaseHeld) as refused:
        acquire(engine, this_process(engine, "127.0.0.1:9000"), NOW + 1)
    message = str(refused.value)
    assert str(engine.url.database) in message
    assert f"pid {sleeper.pid}" in message and "127.0.0.1:8123" in message
    assert f"kill {sleeper.pid}" in message and "--db" in message
    assert row(engine) == before and first.term == 1


def test_competing_servers_one_wins(tmp_path: Path) -> None:
    """Eight servers, each with its own engine, ask at once: one term, one winner."""
    path = tmp_path / "gpulane.db"
    open_database(path).dispose()
    engines = [open_database(path) for _ in range(8)]
    start = threading.Barrier(len(engines))
    won: list[int] = []
    refused: list[int] = []

    def contend(i: int) -> None:
        start.wait()
        try:
            acquire(engines[i], holder(1000 + i), NOW, alive=always(True))
            won.append(i)
        except LeaseHeld:
            refused.append(i)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(won) == 1 and len(refused) == len(engines) - 1
        lease = row(engines[0])
        assert lease is not None and (lease.term, lease.pid) == (1, 1000 + won[0])
    finally:
        for e in engines:
            e.dispose()


def test_an_expired_lease_is_taken_over_with_the_next_term(engine: Engine) -> None:
    acquire(engine, holder(1, "127.0.0.1:1111"), NOW, alive=always(True))
    with pytest.raises(LeaseHeld):
        acquire(engine, holder(2), NOW + LEASE_TTL_S - 0.5, alive=always(True))
    lease = acquire(engine, holder(2), NOW + LEASE_TTL_S, alive=always(True))
    assert (lease.term, lease.previous_ended) == (2, "expired")
    assert lease.event(1) == ev.LeaseAcquired(
        at=1,
        term=2,
        pid=2,
        host=HOST,
        listen="127.0.0.1:8080",
        previous_pid=1,
        previous_host=HOST,
        previous_listen="127.0.0.1:1111",
        previous_ended="expired",
    )


def test_a_released_lease_is_taken_at_once_and_the_term_goes_on(engine: Engine) -> None:
    first = acquire(engine, holder(1), NOW, alive=always(True))
    assert release(engine, first, NOW + 1)
    released = row(engine)
    assert released is not None and released.term == 1 and released.released
    lease = acquire(engine, holder(2), NOW + 1, alive=always(True))
    assert (lease.term, lease.previous_ended) == (2, "released")


def test_a_killed_holder_never_blocks_a_restart(
    engine: Engine, sleeper: subprocess.Popen[bytes]
) -> None:
    acquire(engine, holder_of(engine, sleeper.pid), NOW)
    with pytest.raises(LeaseHeld):
        acquire(engine, this_process(engine, "127.0.0.1:9000"), NOW + 1)
    sleeper.kill()
    sleeper.wait()
    lease = acquire(engine, this_process(engine, "127.0.0.1:9000"), NOW + 1)
    assert (lease.term, lease.previous_ended) == (2, "gone")
    assert lease.previous is not None and lease.previous.pid == sleeper.pid


def test_a_lease_on_another_host_lapses_only_by_expiry(engine: Engine) -> None:
    other = holder(os.getpid() + 999_999, host=HOST + "-elsewhere")
    acquire(engine, other, NOW)  # its pid does not exist here: it is not looked up
    with pytest.raises(LeaseHeld, match=f"on host {HOST}-elsewhere"):
        acquire(engine, this_process(engine, "127.0.0.1:9000"), NOW + 1)
    lease = acquire(engine, this_process(engine, "127.0.0.1:9000"), NOW + LEASE_TTL_S)
    assert lease.previous_ended == "expired"


def test_gpulane_host_names_the_host_in_the_lease_in_place_of_the_host_name(
    engine: Engine, sleeper: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fronts on two machines with one host name: each names its own with
    GPULANE_HOST, so neither looks the other's pid up on its own machine."""
    monkeypatch.setenv("GPULANE_HOST", "front-1")
    first = this_process(engine, "127.0.0.1:9000")
    assert first.host == "front-1" and first.name.startswith("front-1:")
    acquire(engine, first, NOW)
    monkeypatch.setenv("GPULANE_HOST", "front-2")
    # Its pid exists on no host here; as front-2 this process does not look it up.
    gone = holder(sleeper.pid + 999_999, host="front-1")
    assert holder_alive(LeaseRow(1, gone.name, gone.pid, "front-1", "", NOW, NOW, NOW), "") is None
    with pytest.raises(LeaseHeld, match="on host front-1, listening"):
        acquire(engine, this_process(engine, "127.0.0.1:9001"), NOW + 1)
    monkeypatch.setenv("GPULANE_HOST", "front-1")
    assert holder_alive(LeaseRow(1, gone.name, gone.pid, "front-1", "", NOW, NOW, NOW), "") is False


def test_a_copy_of_the_file_does_not_name_the_server_of_the_original(
    tmp_path: Path, engine: Engine, sleeper: subprocess.Popen[bytes]
) -> None:
    acquire(engine, holder_of(engine, sleeper.pid), NOW)
    engine.dispose()  # the last connection's close checkpoints the WAL into the file
    copy = tmp_path / "copy.db"
    shutil.copyfile(tmp_path / "gpulane.db", copy)
    copied = open_database(copy)
    try:
        lease = acquire(copied, this_process(copied, "127.0.0.1:9000"), NOW + 1)
        assert (lease.term, lease.previous_ended) == (2, "gone")
        with pytest.raises(LeaseHeld):  # the original is still served
            acquire(engine, this_process(engine, "127.0.0.1:9001"), NOW + 1)
    finally:
        copied.dispose()


# -- whether a holder is alive -------------------------------------------------------


def test_holder_alive_tells_a_live_process_from_a_reused_pid_a_zombie_and_another_host(
    engine: Engine, sleeper: subprocess.Popen[bytes]
) -> None:
    db = database_id(engine)

    def as_row(pid: int, name: str, host: str = HOST) -> LeaseRow:
        return LeaseRow(1, name, pid, host, "127.0.0.1:1", NOW, NOW, NOW + LEASE_TTL_S)

    live = holder_of(engine, sleeper.pid)
    assert holder_alive(as_row(sleeper.pid, live.name), db) is True
    reused = holder_name(HOST, sleeper.pid, "another-boot/1", db)
    assert holder_alive(as_row(sleeper.pid, reused), db) is False
    assert holder_alive(as_row(sleeper.pid, live.name, host="elsewhere"), db) is None
    sleeper.kill()
    os.waitid(os.P_PID, sleeper.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped
    assert holder_alive(as_row(sleeper.pid, live.name), db) is False
    sleeper.wait()
    assert holder_alive(as_row(sleeper.pid, live.name), db) is False


# -- renew, release, fencing -----------------------------------------------------------


def test_renewal_extends_the_lease_within_its_term(engine: Engine) -> None:
    lease = acquire(engine, holder(1), NOW, alive=always(True))
    renewed = renew(engine, lease, NOW + 10)
    assert renewed.expires_at == NOW + 10 + LEASE_TTL_S
    current = row(engine)
    assert current is not None and (current.renewed_at, current.term) == (NOW + 10, 1)
    with pytest.raises(LeaseHeld):  # still live at the first expiry
        acquire(engine, holder(2), NOW + LEASE_TTL_S + 1, alive=always(True))


def test_a_holder_whose_lease_was_taken_over_is_fenced(engine: Engine) -> None:
    old = acquire(engine, holder(1), NOW, alive=always(True))
    new = acquire(engine, holder(2, "127.0.0.1:2222"), NOW + LEASE_TTL_S, alive=always(True))
    with pytest.raises(LeaseLost, match=r"pid 2 .*127\.0\.0\.1:2222, term 2 .*held term 1"):
        renew(engine, old, NOW + LEASE_TTL_S + 1)
    assert not release(engine, old, NOW + LEASE_TTL_S + 2)
    with engine.connect() as conn:
        assert holds(conn, new.term) and not holds(conn, old.term)
    current = row(engine)
    assert current is not None and (current.term, current.pid) == (2, 2)
    assert current.expires_at == NOW + 2 * LEASE_TTL_S  # untouched by the old holder
    renew(engine, new, NOW + LEASE_TTL_S + 3)


async def test_leadership_stops_at_the_first_renewal_after_a_take_over(engine: Engine) -> None:
    clock = [NOW]
    lost: list[str] = []
    leadership = Leadership(engine, holder(1), clock=lambda: clock[0], alive=always(True))
    leadership.on_lost = lost.append
    leadership.take()
    clock[0] += 5
    assert await leadership.renew_once()
    assert leadership.lease is not None
    assert leadership.lease.expires_at == NOW + 5 + LEASE_TTL_S
    acquire(engine, holder(2), NOW + 5 + LEASE_TTL_S, alive=always(True))
    clock[0] += 5
    assert not await leadership.renew_once()
    assert not await leadership.renew_once()
    assert len(lost) == 1 and "took over" in lost[0] and leadership.lost == lost[0]
    await leadership.release()  # not its lease any more: nothing changes
    current = row(engine)
    assert current is not None and current.pid == 2 and not current.released


async def test_leadership_releases_on_a_clean_stop(engine: Engine) -> None:
    clock = [NOW]
    leadership = Leadership(engine, holder(1), clock=lambda: clock[0], alive=always(True))
    leadership.take()
    clock[0] = NOW + 1
    leadership.ttl = 0.03  # renewals every 0.01 s
    keeping = asyncio.create_task(leadership.keep())
    await wait_until(
        lambda: (renewed := row(engine)) is not None and renewed.renewed_at == NOW + 1,
        "the first renewal on disk",
    )
    keeping.cancel()
    await leadership.release()
    current = row(engine)
    assert current is not None and current.released and current.term == 1


# -- the event in the log --------------------------------------------------------------


def test_lease_acquired_changes_no_state_no_read_model_and_passes_verify_and_check() -> None:
    events = generate_events(film(2), ScoringParams())
    with_lease: list[ev.AnyEvent] = []
    for i, e in enumerate(events):
        with_lease.append(e)
        if i % 50 == 0:  # before the first server_started too (it leads it in a real log)
            with_lease.append(ev.LeaseAcquired(at=e.at, term=i + 1, pid=1, listen="h:1"))
    plain, leased = verify(enumerate(events, 1)), verify(enumerate(with_lease, 1))
    assert leased.ok and leased.decisions == plain.decisions
    assert audit(enumerate(with_lease, 1)).violations == []


async def test_lease_acquired_leaves_the_read_models_as_they_were(tmp_path: Path) -> None:
    engines = [open_database(tmp_path / f"{name}.db") for name in ("plain", "leased")]
    events = generate_events(film(1), ScoringParams())[:200]
    lease_event = ev.LeaseAcquired(at=events[-1].at, term=2, pid=1, host="h", listen="h:1")
    tables: list[dict[str, list[tuple[object, ...]]]] = []
    try:
        for engine, log in zip(engines, (events, [*events, lease_event]), strict=True):
            store = SqliteEventStore(engine)
            store.start()
            await store.append(log)
            await store.close()
            with engine.connect() as conn:
                tables.append(
                    {t.name: [tuple(r) for r in conn.execute(t.select())] for t in READ_MODELS}
                )
    finally:
        for engine in engines:
            engine.dispose()
    # The projection position is one event further; nothing else differs.
    positions = [t.pop("projection_position") for t in tables]
    assert [p[0][1] for p in positions] == [len(events), len(events) + 1]
    assert tables[0] == tables[1]


def _started(at: int) -> ev.ServerStarted:
    return ev.ServerStarted(
        at=at,
        version="t",
        config_hash="h",
        scheduler="serial",
        aging_divisor_ns=1,
        swap_affinity_bonus=0,
    )


@pytest.fixture(params=BACKENDS)
def any_engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """An empty database on each backend the lease runs on."""
    url = (
        request.getfixturevalue("postgres_url")
        if request.param == "postgres"
        else tmp_path / "gpulane.db"
    )
    engine = open_database(url)
    yield engine
    engine.dispose()


async def test_the_event_store_of_a_taken_over_server_writes_nothing_more(
    any_engine: Engine,
) -> None:
    """Fenced appends: the term is checked in the transaction that writes, so a
    server taken over between two renewals cannot slip a batch in (whatever its
    renewal loop has yet to notice)."""
    engine = any_engine
    old = acquire(engine, holder(1), NOW, alive=always(True))
    store = SqliteEventStore(engine, fence=partial(lease_store.fence, old.term))
    fenced: list[str] = []
    store.on_fenced = fenced.append
    store.start()
    try:
        await store.append([_started(1)])
        acquire(engine, holder(2), NOW + LEASE_TTL_S, alive=always(True))
        kept = store.submit([_started(2)])
        await wait_until(lambda: fenced or kept.done(), "the write to be fenced or stored")
        with engine.connect() as conn:
            stored = conn.exec_driver_sql("SELECT count(*) FROM events").scalar()
        assert stored == 1, "a server whose lease was taken over wrote to the log"
        assert not kept.done()
        assert len(fenced) == 1 and "term 1" in fenced[0] and store.failure is not None
        store.submit([_started(3)])  # nor does a later batch get in, up to the close
    finally:
        await store.close()
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM events").scalar() == 1
