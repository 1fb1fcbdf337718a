"""The event log, on SQLite or PostgreSQL: one writer task with group commit,
and the reads over it.

Callers never touch the database. `submit` queues events and returns a future; the
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
without bound (620 MB in a 4 s benchmark). `close` runs one TRUNCATE
checkpoint, so after a clean stop the `.db` file alone holds everything.

A batch that fails because of one of its events (an integer SQLite cannot
hold, say) is redone with a savepoint per `submit` call: only that call's
future fails. A failure of the database itself (locked, full, read-only, an
I/O error) forgets nothing: the batch is kept, in order, ahead of whatever is
submitted meanwhile, `failure` says why, and the writer tries again with a
backoff (RETRY_FIRST_S doubling to RETRY_MAX_S) until the database accepts it.
The run loop applied those events already, so dropping them would leave the
live state ahead of the log for good (a job `running` forever, run again after
a restart); while `failure` is set the server admits and starts nothing new,
and its futures stay pending until the events are on disk. Only `close` gives
up, after CLOSE_RETRY_S, and says how many events were lost.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import sqlalchemy
from sqlalchemy import Row, func, select
from sqlalchemy.engine import Engine

from app.core.events import AnyEvent, decode, encode, model_of, request_id_of, type_name
from app.store import read_model
from app.store.cursor import Cursor, driver_cursor, is_storage_fault, on_sqlite, pipelined
from app.store.engine import describe
from app.store.lease import LeaseLost
from app.store.port import StoreError
from app.store.tables import OPEN_STATUSES, processes, requests
from app.store.tables import events as events_table

log = logging.getLogger(__name__)

CHUNK = 256
"""Events inserted between yields to the event loop (a few ms of work)."""

RETRY_FIRST_S = 0.05
"""The first wait before writing a refused batch again; doubles each time."""
RETRY_MAX_S = 2.0
"""The longest wait between tries: a freed disk is written within this."""
CLOSE_RETRY_S = 10.0
"""How long `close` keeps trying a refused batch before it gives up on it."""

_INSERT = "INSERT INTO events (seq, at, type, request_id, model, data) VALUES (?, ?, ?, ?, ?, ?)"
_LAST_SEQ = "SELECT seq FROM sqlite_sequence WHERE name = 'events'"
# Under WRITE_LOCK (app/store/engine.py): nobody else appends meanwhile.
_LAST_SEQ_POSTGRES = "SELECT max(seq) FROM events"

_Pending = tuple[Sequence[AnyEvent], "asyncio.Future[list[int]]"]


def next_seq(cur: Cursor) -> int:
    """The seq the next event gets. Call with the write lock held
    (`sqlite_begin="IMMEDIATE"`: BEGIN IMMEDIATE, or PostgreSQL's WRITE_LOCK).

    Seqs are assigned here rather than by the database so one executemany can
    insert many events; on SQLite AUTOINCREMENT's counter keeps them from ever
    being reused, on PostgreSQL events are never deleted and the lock keeps
    out any other writer.
    """
    row = cur.execute(_LAST_SEQ if on_sqlite(cur) else _LAST_SEQ_POSTGRES).fetchone()
    return (row[0] if row and row[0] is not None else 0) + 1


def write_events(cur: Cursor, first: int, events: Sequence[AnyEvent]) -> None:
    """Insert events as seqs first, first + 1, ... and project them, in the caller's transaction."""
    with pipelined(cur):
        _write_events(cur, first, events)


def _write_events(cur: Cursor, first: int, events: Sequence[AnyEvent]) -> None:
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


async def write_until_accepted(write: Callable[[], object], what: str) -> None:
    """Run `write` in a thread, again with the event writer's backoff for as long
    as the database refuses it (is_storage_fault): a job's result must be on
    disk before its completion is recorded, and losing it would run the job twice."""
    delay = RETRY_FIRST_S
    while True:
        try:
            await asyncio.to_thread(write)
            return
        except Exception as exc:
            cause = exc.orig if isinstance(exc, sqlalchemy.exc.DBAPIError) else exc
            if cause is None or not is_storage_fault(cause):
                raise
            if delay == RETRY_FIRST_S:
                log.error("%s refused by the database (%s); retrying", what, describe(exc))
        await asyncio.sleep(delay)
        delay = min(delay * 2, RETRY_MAX_S)


def _label(group: Sequence[AnyEvent]) -> str:
    """`request_enqueued of request r1 (+1 more)`: which events a failure is about."""
    rid = request_id_of(group[0])
    label = type_name(group[0]) + (f" of request {rid}" if rid else "")
    return label + (f" (+{len(group) - 1} more)" if len(group) > 1 else "")


class _Worker:
    """One thread that runs, in order, the calls handed to it: the writer's BEGIN
    and COMMIT. `run_in_executor` on a ThreadPoolExecutor cost more CPU than the
    hop needs (a Python queue with its locks, two chained futures); one request
    at a time it was a tenth of the event store's CPU (docs/benchmarks.md)."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future[Any]] | None]
        self._calls = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def run(self, call: Callable[[], Any]) -> asyncio.Future[Any]:
        """`call()` in the thread; its result (or exception) on the running loop."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls.put((call, future))
        return future

    def _work(self) -> None:
        while (item := self._calls.get()) is not None:
            call, future = item
            try:
                result = call()
            except BaseException as exc:
                future.get_loop().call_soon_threadsafe(_settle, future, None, exc)
            else:
                future.get_loop().call_soon_threadsafe(_settle, future, result, None)

    def shutdown(self) -> None:
        """Wait for the calls handed over so far, then end the thread."""
        self._calls.put(None)
        self._thread.join()


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


class _EventFault(Exception):
    """A batch failed because of one of its events, not because of the database."""


class SqlEventStore:
    """The event store over an engine from `app.store.engine.open_database`."""

    def __init__(
        self, engine: Engine, fence: Callable[[sqlalchemy.Connection], None] | None = None
    ) -> None:
        """`fence` runs in every write transaction before anything is written and
        raises LeaseLost when this server no longer holds the log's lease, so a
        server that was taken over writes nothing more (app/store/lease.py)."""
        self.failure: str | None = None
        self.on_fenced: Callable[[str], None] | None = None
        """Called once a write finds the lease lost; serve stops the process."""
        self._fence = fence
        self.retry_in: float = 0.0
        """Seconds until the next try while `failure` is set (for Retry-After)."""
        self._engine = engine
        self._listeners: list[Callable[[], None]] = []
        self._conn: sqlalchemy.Connection | None = None
        self._pending: list[_Pending] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._closed = False
        # One thread for BEGIN and COMMIT, so they never block the event loop.
        self._thread = _Worker("gpulane-events")

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

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener` whenever `failure` is set or cleared."""
        self._listeners.append(listener)

    def _set_failure(self, failure: str | None) -> None:
        changed = (failure is None) != (self.failure is None)
        self.failure = failure
        if changed:
            for listener in self._listeners:
                listener()

    async def close(self) -> None:
        if self._closed:
            return
        self._closing = True
        if self._task is not None and self._wakeup is not None:
            self._wakeup.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), CLOSE_RETRY_S)
            except TimeoutError:
                self._task.cancel()
                lost = self._pending
                self._pending = []
                count = sum(len(group) for group, _ in lost)
                log.error(
                    "event store: closing with %d events that the database still refuses "
                    "(%s); they are lost, and a job they concern runs again at the next start",
                    count,
                    self.failure,
                )
                for _, future in lost:
                    if not future.done():
                        future.set_exception(StoreError(f"not stored: {self.failure}"))
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        try:
            await self._thread.run(self._checkpoint)
        except Exception as exc:  # the data is safe in the WAL; only the copy-the-file case suffers
            log.warning("event store: WAL not checkpointed at close: %s", describe(exc))
        self._thread.shutdown()
        self._closed = True

    def _checkpoint(self) -> None:
        """Move the WAL into the .db file and empty it, so after a clean stop the file
        is whole. (PostgreSQL's server checkpoints its own WAL.)"""
        if self._engine.dialect.name != "sqlite":
            return
        raw = self._engine.raw_connection()
        try:
            dbapi = raw.driver_connection
            assert isinstance(dbapi, sqlite3.Connection)
            # Outside any transaction (isolation_level None); waits busy_timeout for readers.
            busy, wal_frames, _ = dbapi.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        finally:
            raw.close()
        if busy:
            log.warning(
                "event store: WAL not emptied at close (a reader held it); %d frames stay "
                "in the -wal file until the next start",
                wal_frames,
            )

    def read(
        self, after_seq: int = 0, limit: int | None = None, request_id: str | None = None
    ) -> list[tuple[int, AnyEvent]]:
        return list(read_events(self._engine, after_seq, limit, request_id))

    async def _run(self) -> None:
        assert self._wakeup is not None
        delay = RETRY_FIRST_S
        while True:
            if not self._pending:
                if self._closing:
                    return
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            # Everything submitted while the previous transaction ran is one group.
            batch, self._pending = self._pending, []
            try:
                await self._store(batch)
            except LeaseLost as exc:
                # Another server holds the log now: write nothing more, ever.
                self._pending = batch + self._pending
                self._set_failure(f"fenced: {exc}")
                log.error("event store: %s; nothing more is written", exc)
                if self.on_fenced is not None:
                    self.on_fenced(str(exc))
                await self._wakeup.wait()  # until close
                self._wakeup.clear()
                if self._closing:
                    return
                continue
            except Exception as exc:  # the database refuses: keep the batch and try again
                # Ahead of what came meanwhile, so the log keeps the order of submits.
                self._pending = batch + self._pending
                count = sum(len(group) for group, _ in self._pending)
                if self.failure is None:
                    log.error(
                        "event store: the database refuses writes (%s); %d events kept, "
                        "retrying; admitting and starting nothing new meanwhile",
                        describe(exc),
                        count,
                    )
                self._set_failure(describe(exc))
                self.retry_in = delay
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            if self.failure is not None:
                log.warning(
                    "event store: writing again; %d events kept while it refused are stored",
                    sum(len(group) for group, _ in batch),
                )
                delay = RETRY_FIRST_S
                self.retry_in = 0.0
                self._set_failure(None)

    async def _store(self, batch: list[_Pending]) -> None:
        """Commit a batch and resolve its futures; raises only for a storage-wide failure."""
        try:
            first = await self._commit([e for group, _ in batch for e in group])
        except _EventFault:
            # Some event cannot be stored. Redo the batch with each submitter's
            # events under a savepoint, so only the bad group is left out.
            outcomes = await self._commit_isolating(batch)
        else:
            outcomes = []
            for group, _ in batch:
                outcomes.append(list(range(first, first + len(group))))
                first += len(group)
        for (group, future), outcome in zip(batch, outcomes, strict=True):
            if future.done():
                continue
            if isinstance(outcome, list):
                future.set_result(outcome)
                continue
            message = f"{_label(group)} not stored: {describe(outcome)}"
            log.error("event store: %s; the rest of its batch was stored", message)
            future.set_exception(StoreError(message))

    async def _commit(self, events: list[AnyEvent]) -> int:
        """One transaction for `events`; returns the seq of the first.

        Raises _EventFault when the failure came from one of the events rather
        than from the database (nothing is stored either way).
        """
        conn = await self._thread.run(self._begin)
        try:
            cur = driver_cursor(conn)
            first = next_seq(cur)
            for start in range(0, len(events), CHUNK):
                if start:
                    await asyncio.sleep(0)
                try:
                    write_events(cur, first + start, events[start : start + CHUNK])
                except Exception as exc:
                    if is_storage_fault(exc):
                        raise
                    raise _EventFault from exc
            await self._thread.run(conn.commit)
        except Exception:
            await self._discard(conn)
            raise
        return first

    async def _commit_isolating(self, batch: list[_Pending]) -> list[list[int] | Exception]:
        """One transaction, one savepoint per group: each group's seqs, or why it was left out."""
        conn = await self._thread.run(self._begin)
        outcomes: list[list[int] | Exception] = []
        try:
            cur = driver_cursor(conn)
            seq = next_seq(cur)
            since_yield = 0
            for group, _ in batch:
                if since_yield >= CHUNK:
                    await asyncio.sleep(0)
                    since_yield = 0
                since_yield += len(group)
                cur.execute("SAVEPOINT event_group")
                try:
                    write_events(cur, seq, group)
                except Exception as exc:
                    if is_storage_fault(exc):
                        raise
                    cur.execute("ROLLBACK TO event_group")
                    outcomes.append(exc)
                else:
                    outcomes.append(list(range(seq, seq + len(group))))
                    seq += len(group)
                cur.execute("RELEASE event_group")
            await self._thread.run(conn.commit)
        except Exception:
            await self._discard(conn)
            raise
        return outcomes

    async def _discard(self, conn: sqlalchemy.Connection) -> None:
        # Start the next batch on a fresh connection, whatever state this one is in.
        self._conn = None
        await self._thread.run(conn.close)

    def _begin(self) -> sqlalchemy.Connection:
        try:
            if self._conn is None:
                self._conn = self._engine.connect()
                self._conn.execution_options(sqlite_begin="IMMEDIATE")
            self._conn.begin()
            if self._fence is not None:
                self._fence(self._conn)
        except Exception:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            raise
        return self._conn


SqliteEventStore = SqlEventStore
"""Its name before it ran on PostgreSQL too."""


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
    # PostgreSQL sends a whole result at once unless read through a server-side cursor.
    options = {"yield_per": 5000} if conn.dialect.name != "sqlite" else {}
    result = conn.execute(
        query.order_by(events_table.c.seq).limit(limit), execution_options=options
    )
    yield from ((seq, data) for seq, data in result)


def read_events(
    engine: Engine, after_seq: int = 0, limit: int | None = None, request_id: str | None = None
) -> Iterator[tuple[int, AnyEvent]]:
    """Committed events with seq > after_seq in seq order, decoded; streams."""
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
