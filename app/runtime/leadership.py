"""Winning, keeping and losing the server lease (app/store/lease.py says what it is).

One gpulane leads a database: it holds the lease, renews it every third of its
TTL (`database.leaseSeconds`) and fences every append with its term. The
others are standbys (`gpulane serve --standby`): `wait_to_lead` polls the row
without a write lock and asks for the lease only once `ended_by` says its term
has ended (expired, released, or its holder gone from this host); it then
takes over with the next term, and serve runs the same recovery as after a
crash.

A leader trusts itself only until its lease's expiry minus a margin
(`trusted`), by its own clock: a leader that was paused or cut off past that
dispatches nothing until a renewal succeeds, so it never overlaps a standby
that took over (whose clock may run a little ahead: the margin). A renewal
that finds the term changed means another gpulane took over: `on_lost` is
called once and serve exits at once without writing anything more (exit 3; a
service manager that restarts it with --standby makes it the new standby). A
renewal that fails because the database cannot be written is logged and tried
again at the next tick; if nobody took over meanwhile the next successful
renewal extends the lease (the term is unchanged) and `on_renewed` lets the
scheduler dispatch again. `release` expires the lease on a clean stop, so a
standby takes over at its next poll.

Renewals and takeovers run in a thread: each waits for the write lock like
any writer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import sqlalchemy
from sqlalchemy import Connection
from sqlalchemy.engine import Engine

from app.store.engine import DatabaseError, describe
from app.store.lease import (
    LEASE_TTL_S,
    Holder,
    Lease,
    LeaseHeld,
    LeaseLost,
    LeaseRow,
    acquire,
    database_id,
    ended_by,
    fence,
    holder_alive,
    peek,
    release,
    renew,
)

log = logging.getLogger("gpulane.lease")

RENEWALS_PER_TTL = 3
"""A leader renews every TTL / 3: two renewals may fail before the lease lapses."""
TRUST_MARGIN = 0.2
"""Of the TTL: how long before its lease's expiry a leader stops trusting itself
(clock skew between hosts, a renewal's own duration)."""
POLLS_PER_TTL = 30
"""A standby reads the lease every TTL / 30 (0.5 s by default): the failover time
when the leader's process is found gone."""


class Leadership:
    """This process's side of the lease: standby, leader, or fenced."""

    def __init__(
        self,
        engine: Engine,
        holder: Holder,
        *,
        ttl: float = LEASE_TTL_S,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        alive: Callable[[LeaseRow], bool | None] | None = None,
    ) -> None:
        """`clock` gives wall-clock unix seconds (the lease's times); `alive` says
        whether a row's holder still runs (default: `holder_alive` on this host)."""
        self.engine = engine
        self.holder = holder
        self.ttl = ttl
        self.clock = clock
        self.sleep = sleep
        database = database_id(engine)
        self.alive = alive or (lambda row: holder_alive(row, database))
        self.lease: Lease | None = None
        """The lease this process holds; None while it is a standby."""
        self.leader: LeaseRow | None = None
        """The lease as a standby last read it: who leads, until when."""
        self.lost: str | None = None
        """Why the lease was lost; None while this process holds it (or never did)."""
        self.on_lost: Callable[[str], None] = lambda reason: None
        """Called once when a renewal or a fenced write finds another term."""
        self.on_renewed: Callable[[], None] = lambda: None
        """Called after a renewal that restored a trust that had lapsed."""

    @property
    def every(self) -> float:
        """Seconds between renewals."""
        return self.ttl / RENEWALS_PER_TTL

    @property
    def poll(self) -> float:
        """Seconds between a standby's reads of the lease."""
        return self.ttl / POLLS_PER_TTL

    # -- winning ----------------------------------------------------------------

    def take(self) -> Lease:
        """One try for the lease: the lease, or `LeaseHeld` naming its holder
        (kept in `leader`); `DatabaseError` when the database cannot be used."""
        try:
            lease = acquire(self.engine, self.holder, self.clock(), ttl=self.ttl, alive=self.alive)
        except LeaseHeld as exc:
            self.leader = exc.row or self.leader
            raise
        self.lease = lease
        self.leader = None
        return lease

    async def wait_to_lead(self) -> Lease:
        """Wait as a standby until this process takes the lease; returns it. Only
        a lease whose term has ended is asked for (a read, no write lock, until
        then); a database that cannot be read is logged and read again."""
        while True:
            try:
                row = await asyncio.to_thread(peek, self.engine)
                if row is None or ended_by(row, self.clock(), self.alive) is not None:
                    return await asyncio.to_thread(self.take)
                self.leader = row
            except LeaseHeld:
                pass  # another standby was faster: it leads now
            except (DatabaseError, sqlalchemy.exc.SQLAlchemyError) as exc:
                log.warning("standby: cannot read the server lease: %s", exc)
            await self.sleep(self.poll)

    def retry_after(self) -> int:
        """Whole seconds until the leader's lease lapses unless it renews: the
        earliest a standby can take over (at least 1)."""
        if self.leader is None:
            return 1
        return max(1, int(self.leader.expires_at - self.clock() + 0.999))

    # -- keeping ----------------------------------------------------------------

    def trusted(self) -> bool:
        """Whether this process may dispatch: it holds the lease, and its own
        clock is short of the lease's expiry by the margin."""
        lease = self.lease
        if lease is None or self.lost is not None:
            return False
        return self.clock() < lease.expires_at - TRUST_MARGIN * self.ttl

    def fence(self, conn: Connection) -> None:
        """The event store's fence: raise LeaseLost unless this process's term
        still holds the lease, read in the writing transaction."""
        if self.lease is None:
            raise LeaseLost("this gpulane is a standby: it writes nothing until it leads")
        fence(self.lease.term, conn)

    async def keep(self) -> None:
        """Renew every `every` seconds until cancelled or the lease is lost."""
        while self.lost is None:
            await self.sleep(self.every)
            await self.renew_once()

    async def renew_once(self) -> bool:
        """One renewal; False when the lease is lost (`on_lost` has been called)."""
        lease = self.lease
        if self.lost is not None or lease is None:
            return False
        was_trusted = self.trusted()
        try:
            self.lease = await asyncio.to_thread(
                renew, self.engine, lease, self.clock(), ttl=self.ttl
            )
        except LeaseLost as exc:
            self.lose(str(exc))
            return False
        except sqlalchemy.exc.SQLAlchemyError as exc:
            log.warning(
                "could not renew the server lease (term %d): %s; %s",
                lease.term,
                describe(exc),
                _lapse(lease.expires_at - self.clock()),
            )
            return True
        if not was_trusted:
            self.on_renewed()
        return True

    def lose(self, reason: str) -> None:
        """Another term took over: remember why and tell `on_lost`, once."""
        if self.lost is not None:
            return
        self.lost = reason
        log.error("lease lost: %s", reason)
        self.on_lost(reason)

    async def release(self) -> None:
        """Expire the lease (clean stop), unless it was lost or never held; a
        failure is logged (the lease then lapses after its TTL)."""
        if self.lost is not None or self.lease is None:
            return
        try:
            await asyncio.to_thread(release, self.engine, self.lease, self.clock())
        except sqlalchemy.exc.SQLAlchemyError as exc:
            log.warning("could not release the server lease: %s", describe(exc))


def _lapse(left_s: float) -> str:
    """When the lease lapses, as a failed renewal says it: never a negative time."""
    if left_s > 0:
        return f"it lapses in {left_s:.0f} s unless a renewal succeeds"
    return (
        f"it lapsed {-left_s:.0f} s ago: this server dispatches nothing, a standby may "
        "take over, and a renewal that succeeds before then keeps the same term"
    )
