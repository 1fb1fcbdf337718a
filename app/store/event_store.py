"""The SQLite event log: one writer task with group commit, and the reads over it.

Callers never touch SQLite. `submit` queues events and returns a future; the
writer task takes everything queued since its last transaction and commits it
as one transaction: the events, the read models projected from them
(read_model.project) and the projection position. One fsync covers the whole
group, which is what makes durable appends cheap under load.

Where the work runs was measured (bench/event_store_bench.py): BEGIN (which
may wait for the lock) and COMMIT (the fsync) run in the writer's thread, but
the inserts run on the event loop, in chunks that yield between them. sqlite3
releases the GIL around every statement, so a writer thread doing thousands of
small statements while the loop is busy waits for the GIL at each one; that
convoy halved throughput.

WAL checkpoints stay SQLite's automatic ones, run by the COMMIT that crosses
1000 pages. A checkpointer on its own connection was tried: under continuous
load it never catches up with the writer, so the WAL never restarts and grows
without bound (620 MB in a 4 s benchmark).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import sqlalchemy
from sqlalchemy import Row, func, select
from sqlalchemy.engine import Engine

from app.core.events import AnyEvent, decode, encode, model_of, request_id_of, type_name
from app.store import read_model
from app.store.engine import describe
from app.store.port import StoreError
from app.store.tables import OPEN_STATUSES, processes, requests
from app.store.tables import events as events_table

log = logging.getLogger(__name__)

CHUNK = 256
"""Events inserted between yields to the event loop (a few ms of work)."""

_INSERT = "INSERT INTO events (seq, at, type, request_id, model, data) VALUES (?, ?, ?, ?, ?, ?)"
_LAST_SEQ = "SELECT seq FROM sqlite_sequence WHERE name = 'events'"

_Pending = tuple[Sequence[AnyEvent], "asyncio.Future[list[int]]"]


def driver_cursor(conn: sqlalchemy.Connection) -> sqlite3.Cursor:
    """The sqlite3 cursor inside an SQLAlchemy connection (and its transaction)."""
    dbapi = conn.connection.dbapi_connection
    assert isinstance(dbapi, sqlite3.Connection)
    return dbapi.cursor()


def next_seq(cur: sqlite3.Cursor) -> int:
    """The seq the next event gets. Call with the write lock held (BEGIN IMMEDIATE).

    Seqs are assigned here rather than by SQLite so one executemany can insert
    many events; AUTOINCREMENT's counter keeps them from ever being reused.
    """
    row = cur.execute(_LAST_SEQ).fetchone()
    return (row[0] if row else 0) + 1


def write_events(cur: sqlite3.Cursor, first: int, events: Sequence[AnyEvent]) -> None:
    """Insert events as seqs first, first + 1, ... and project them, in the caller's transaction."""
    cur.executemany(
        _INSERT,
        [
            (
                first + i,
                read_model.seconds(e.at),
                type_name(e),
                request_id_of(e),
                model_of(e),
                encode(e).decode(),
            )
            for i, e in enumerate(events)
        ],
    )
    read_model.project_all(cur, zip(range(first, first + len(events)), events, strict=True))


class SqliteEventStore:
    """The event store over an engine from `app.store.engine.open_database`."""

    def __init__(self, engine: Engine) -> None:
        self.failure: str | None = None
        self._engine = engine
        self._conn: sqlalchemy.Connection | None = None
        self._pending: list[_Pending] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._closed = False
        # One thread for BEGIN and COMMIT, so they never block the event loop.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpulane-events")

    def start(self) -> None:
        if self._task is not None:
            raise StoreError("event store already started")
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="event-writer")

    def submit(self, events: Sequence[AnyEvent]) -> asyncio.Future[list[int]]:
        if self._task is None or self._wakeup is None:
            raise StoreError("event store not started")
        if self._closing:
            raise StoreError("event store is closed")
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        if not events:
            future.set_result([])
            return future
        self._pending.append((events, future))
        self._wakeup.set()
        return future

    async def append(self, events: Sequence[AnyEvent]) -> list[int]:
        return await self.submit(events)

    async def close(self) -> None:
        if self._closed:
            return
        self._closing = True
        if self._task is not None and self._wakeup is not None:
            self._wakeup.set()
            await self._task
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._thread.shutdown(wait=True)
        self._closed = True

    def read(
        self, after_seq: int = 0, limit: int | None = None, request_id: str | None = None
    ) -> list[tuple[int, AnyEvent]]:
        return list(read_events(self._engine, after_seq, limit, request_id))

    async def _run(self) -> None:
        assert self._wakeup is not None
        while True:
            if not self._pending:
                if self._closing:
                    return
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            # Everything submitted while the previous transaction ran is one group.
            batch, self._pending = self._pending, []
            events = [e for group, _ in batch for e in group]
            try:
                first = await self._commit(events)
            except Exception as exc:  # a failed write must not kill the writer
                self.failure = describe(exc)
                log.error("event store: %d events not stored: %s", len(events), self.failure)
                for _, future in batch:
                    if not future.done():
                        future.set_exception(StoreError(self.failure))
                continue
            self.failure = None
            for group, future in batch:
                if not future.done():
                    future.set_result(list(range(first, first + len(group))))
                first += len(group)

    async def _commit(self, events: list[AnyEvent]) -> int:
        """One transaction for `events`; returns the seq of the first."""
        loop = asyncio.get_running_loop()
        conn = await loop.run_in_executor(self._thread, self._begin)
        try:
            cur = driver_cursor(conn)
            first = next_seq(cur)
            for start in range(0, len(events), CHUNK):
                if start:
                    await asyncio.sleep(0)
                write_events(cur, first + start, events[start : start + CHUNK])
            await loop.run_in_executor(self._thread, conn.commit)
        except Exception:
            # Start the next batch on a fresh connection, whatever state this one is in.
            self._conn = None
            await loop.run_in_executor(self._thread, conn.close)
            raise
        return first

    def _begin(self) -> sqlalchemy.Connection:
        try:
            if self._conn is None:
                self._conn = self._engine.connect()
                self._conn.execution_options(sqlite_begin="IMMEDIATE")
            self._conn.begin()
        except Exception:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            raise
        return self._conn


def event_rows(
    conn: sqlalchemy.Connection,
    after_seq: int = 0,
    limit: int | None = None,
    request_id: str | None = None,
) -> Iterator[tuple[int, str]]:
    """`(seq, data)` of events with seq > after_seq in seq order, undecoded; streams."""
    query = select(events_table.c.seq, events_table.c.data).where(events_table.c.seq > after_seq)
    if request_id is not None:
        query = query.where(events_table.c.request_id == request_id)
    result = conn.execute(query.order_by(events_table.c.seq).limit(limit))
    yield from ((seq, data) for seq, data in result)


def read_events(
    engine: Engine, after_seq: int = 0, limit: int | None = None, request_id: str | None = None
) -> Iterator[tuple[int, AnyEvent]]:
    """Committed events with seq > after_seq in seq order, decoded; streams from SQLite."""
    with engine.connect() as conn:
        for seq, data in event_rows(conn, after_seq, limit, request_id):
            yield seq, decode(data)


def open_requests(engine: Engine) -> list[Row[Any]]:
    """Requests queued or running, in arrival order: what recovery resumes."""
    query = (
        select(requests)
        .where(requests.c.status.in_(OPEN_STATUSES))
        .order_by(requests.c.enqueue_seq)
    )
    with engine.connect() as conn:
        return list(conn.execute(query))


def open_processes(engine: Engine) -> list[Row[Any]]:
    """Upstream processes started and never seen to stop: what recovery must stop."""
    query = select(processes).where(processes.c.stopped_at.is_(None)).order_by(processes.c.seq)
    with engine.connect() as conn:
        return list(conn.execute(query))


def last_seq(engine: Engine) -> int:
    """The seq of the newest event, 0 for an empty log."""
    with engine.connect() as conn:
        return int(
            conn.execute(select(func.coalesce(func.max(events_table.c.seq), 0))).scalar_one()
        )
