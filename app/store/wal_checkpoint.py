"""WAL checkpoints off the writer's path.

SQLite normally checkpoints inside the COMMIT that crosses `wal_autocheckpoint`
pages, so one unlucky group commit waits for pages to be copied into the
database file and fsynced: that was the writer's worst latency. The writer's
connection turns auto-checkpoints off and this runs PASSIVE checkpoints (they
never block the writer) on a connection and thread of its own.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import sqlalchemy
from sqlalchemy.engine import Engine

log = logging.getLogger(__name__)

CHECKPOINT_EVERY = 4096
"""Events committed between checkpoints (about the pages SQLite's default of 1000 holds)."""


class WalCheckpointer:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._conn: sqlalchemy.Connection | None = None
        self._since = 0
        self._running: asyncio.Future[None] | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpulane-wal")

    def committed(self, events: int) -> None:
        """Count committed events; start a checkpoint when enough have gone by and none runs."""
        self._since += events
        if self._since >= CHECKPOINT_EVERY and (self._running is None or self._running.done()):
            self._since = 0
            self._running = asyncio.get_running_loop().run_in_executor(self._thread, self._run)

    async def close(self) -> None:
        if self._running is not None:
            await self._running
        self._thread.submit(self._close).result()
        self._thread.shutdown(wait=True)

    def _run(self) -> None:
        try:
            if self._conn is None:
                self._conn = self._engine.connect()
            self._conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")
            self._conn.rollback()
        except Exception as exc:  # a checkpoint can always be retried later
            log.warning("WAL checkpoint failed: %s", exc)
            self._close()

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
