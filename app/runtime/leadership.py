"""Holding the server lease while serving (app/store/lease.py says what it is).

`Leadership.keep` renews the lease every RENEW_EVERY_S, each time in a thread
(a renewal waits for the write lock like any writer). A renewal that finds the
term changed means another gpulane took over: `on_lost` is called once, and
serve stops at once, without writing anything more (a fenced server never
writes). A renewal that fails because the database cannot be written is logged
and tried again at the next tick; the lease runs on until it expires, and if
nobody took over meanwhile the next successful renewal extends it (the term is
unchanged). `release` expires the lease on a clean stop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import sqlalchemy
from sqlalchemy.engine import Engine

from app.store.engine import describe
from app.store.lease import LEASE_TTL_S, RENEW_EVERY_S, Lease, LeaseLost, release, renew

log = logging.getLogger("gpulane.lease")


class Leadership:
    def __init__(
        self,
        engine: Engine,
        lease: Lease,
        on_lost: Callable[[str], None],
        *,
        clock: Callable[[], float] = time.time,
        every: float = RENEW_EVERY_S,
        ttl: float = LEASE_TTL_S,
    ) -> None:
        """`clock` gives wall-clock unix seconds (the lease's times)."""
        self.engine = engine
        self.lease = lease
        self.on_lost = on_lost
        self.clock = clock
        self.every = every
        self.ttl = ttl
        self.lost: str | None = None
        """Why the lease was lost; None while this server holds it."""

    async def keep(self) -> None:
        """Renew every `every` seconds until cancelled or the lease is lost."""
        while self.lost is None:
            await asyncio.sleep(self.every)
            await self.renew_once()

    async def renew_once(self) -> bool:
        """One renewal; False when the lease is lost (`on_lost` has been called)."""
        if self.lost is not None:
            return False
        try:
            self.lease = await asyncio.to_thread(
                renew, self.engine, self.lease, self.clock(), ttl=self.ttl
            )
        except LeaseLost as exc:
            self.lost = str(exc)
            log.error("lease lost: %s", exc)
            self.on_lost(self.lost)
            return False
        except sqlalchemy.exc.SQLAlchemyError as exc:
            left = self.lease.expires_at - self.clock()
            log.warning(
                "could not renew the server lease (term %d): %s; it lapses in %.0f s "
                "unless a renewal succeeds",
                self.lease.term,
                describe(exc),
                left,
            )
        return True

    async def release(self) -> None:
        """Expire the lease (clean stop), unless it was lost; a failure is logged
        (the lease then lapses after its TTL)."""
        if self.lost is not None:
            return
        try:
            await asyncio.to_thread(release, self.engine, self.lease, self.clock())
        except sqlalchemy.exc.SQLAlchemyError as exc:
            log.warning("could not release the server lease: %s", describe(exc))
