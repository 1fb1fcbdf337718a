"""The event store contract, run over every implementation (in memory, SQLite,
PostgreSQL), then what the databases must do, then what only SQLite must do."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import sqlite3
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import event as sa_event
from sqlalchemy.engine import Engine

from app.core import events as ev
from app.store import commands, event_store
from app.store.engine import DatabaseError, create_engine, open_database
from app.store.event_store import (
    SqliteEventStore,
    last_seq,
    open_processes,
    open_requests,
    read_events,
)
from app.store.memory_store import InMemoryEventStore
from app.store.port import EventStore, StoreError
from tests.integration.conftest import BACKENDS

FIXTURE = Path(__file__).parents[1] / "fixtures" / "events_v1.jsonl"
T0 = 1_735_689_600_000_000_000


async def wait_until(check: Any, timeout: float = 10) -> None:
    """Poll `check()` on the event loop until it is true (the writer runs there too)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def enqueued(rid: str, at: int = T0, **kw: Any) -> ev.RequestEnqueued:
    fields: dict[str, Any] = {
        "model": "qwen",
        "model_requested": "qwen",
        "endpoint": "/v1/chat/completions",
        "priority": 0,
        "band": "normal",
    }
    return ev.RequestEnqueued(at=at, request_id=rid, **(fields | kw))


@pytest.fixture(params=["memory", *BACKENDS])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[EventStore]:
    engine = None
    s: EventStore
    if request.param == "memory":
        s = InMemoryEventStore()
    else:
        db = tmp_path / "events.db"
        engine = open_database(
            request.getfixturevalue("postgres_url") if request.param == "postgres" else db
        )
        s = SqliteEventStore(engine)
    s.start()
    yield s
    await s.close()
    if engine is not None:
        engine.dispose()


# -- the contract ---------------------------------------------------------------------------


async def test_append_returns_increasing_seqs_and_reads_back_in_order(store: EventStore) -> None:
    first = await store.append([enqueued("a"), enqueued("b")])
    second = await store.append([enqueued("c")])
    assert len(first) == 2 and len(second) == 1
    assert first[0] < first[1] < second[0]
    assert [e.request_id for _, e in store.read()] == ["a", "b", "c"]  # type: ignore[union-attr]
    assert [seq for seq, _ in store.read()] == [*first, *second]


async def test_a_large_group_commits_whole_and_in_order(store: EventStore) -> None:
    seqs = await store.append([enqueued(f"r{i}") for i in range(1000)])
    assert seqs == list(range(seqs[0], seqs[0] + 1000))
    assert [e.request_id for _, e in store.read()] == [f"r{i}" for i in range(1000)]  # type: ignore[union-attr]


async def test_empty_append_is_a_no_op(store: EventStore) -> None:
    assert await store.append([]) == []
    assert store.read() == []


async def test_submit_does_not_wait_and_keeps_call_order(store: EventStore) -> None:
    futures = [store.submit([enqueued(f"r{i}")]) for i in range(50)]
    last = await store.append([enqueued("last")])
    seqs = [seq for f in futures for seq in await f]
    assert seqs == sorted(seqs) and seqs[-1] < last[0]
    assert [e.request_id for _, e in store.read()] == [  # type: ignore[union-attr]
        *(f"r{i}" for i in range(50)),
        "last",
    ]


async def test_many_concurrent_producers_keep_their_own_order(store: EventStore) -> None:
    rng = random.Random(7)
    sent: dict[str, list[str]] = {}

    async def producer(name: str) -> list[int]:
        awaited: list[int] = []
        for i in range(30):
            group = [enqueued(f"{name}-{i}-{j}") for j in range(rng.randint(1, 3))]
            sent.setdefault(name, []).extend(e.request_id for e in group)
            if rng.random() < 0.5:
                awaited += await store.append(group)
            else:
                store.submit(group)
                await asyncio.sleep(0)
        return awaited

    results = await asyncio.gather(*(producer(f"p{n}") for n in range(20)))
    await store.append([enqueued("barrier")])
    events = store.read()
    seqs = [seq for seq, _ in events]
    assert seqs == sorted(set(seqs))
    for name, rids in sent.items():
        logged = [e.request_id for _, e in events if e.request_id.startswith(f"{name}-")]  # type: ignore[union-attr]
        assert logged == rids
    assert all(awaited == sorted(awaited) for awaited in results)


async def test_close_flushes_everything_submitted(store: EventStore) -> None:
    futures = [store.submit([enqueued(f"r{i}")]) for i in range(100)]
    await store.close()
    assert all(f.done() and not f.exception() for f in futures)
    assert len(store.read()) == 100
    with pytest.raises(StoreError):
        store.submit([enqueued("late")])


async def test_every_event_type_reads_back_equal(store: EventStore) -> None:
    originals = [ev.decode(line) for line in FIXTURE.read_text().splitlines()]
    seqs = await store.append(originals)
    assert store.read() == list(zip(seqs, originals, strict=True))


async def test_read_filters(store: EventStore) -> None:
    seqs = await store.append([enqueued("a"), enqueued("b"), enqueued("a", attempt=2)])
    assert [s for s, _ in store.read(request_id="a")] == [seqs[0], seqs[2]]
    assert [s for s, _ in store.read(after_seq=seqs[0])] == seqs[1:]
    assert [s for s, _ in store.read(limit=2)] == seqs[:2]


async def test_submit_before_start_is_refused() -> None:
    with pytest.raises(StoreError):
        InMemoryEventStore().submit([enqueued("a")])


# -- SQLite only ----------------------------------------------------------------------------


async def test_sqlite_submit_before_start_is_refused(tmp_path: Path) -> None:
    engine = open_database(tmp_path / "events.db")
    store = SqliteEventStore(engine)
    with pytest.raises(StoreError, match="not started"):
        store.submit([enqueued("a")])
    await store.close()
    engine.dispose()


async def test_events_survive_reopening_the_file(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    engine = open_database(path)
    store = SqliteEventStore(engine)
    store.start()
    first = await store.append([enqueued("a"), enqueued("b")])
    await store.close()
    engine.dispose()

    engine = open_database(path)
    assert [(s, e.request_id) for s, e in read_events(engine)] == [  # type: ignore[union-attr]
        (first[0], "a"),
        (first[1], "b"),
    ]
    store = SqliteEventStore(engine)
    store.start()
    assert await store.append([enqueued("c")]) == [first[1] + 1]
    await store.close()
    assert last_seq(engine) == first[1] + 1
    engine.dispose()


async def test_read_models_commit_with_their_events(database: str) -> None:
    engine = open_database(database)
    store = SqliteEventStore(engine)
    store.start()
    await store.append([enqueued("a"), enqueued("b", at=T0 + 1)])
    store.submit(
        [
            ev.RequestDispatched(at=T0 + 2, request_id="a", model="qwen"),
            ev.ProcessStarted(at=T0 + 3, model="qwen", pid=41, cmdline=["llama-server", "-m", "q"]),
        ]
    )
    rejected = ev.RequestRejected(
        at=T0 + 4, request_id="bad", endpoint="/v1/chat/completions", http_status=400,
        error="no model", priority=2**62,
    )  # fmt: skip
    seqs = await store.append(
        [rejected, ev.ProcessStarted(at=T0 + 4, model="x", pid=42, cmdline=["x"])]
    )
    await store.close()
    assert [(r.id, r.status) for r in open_requests(engine)] == [("a", "running"), ("b", "queued")]
    with engine.connect() as conn:
        row = conn.exec_driver_sql(
            "SELECT status, durable, priority, http_status FROM requests WHERE id = 'bad'"
        ).one()
    assert tuple(row) == ("failed", False, 2**62, 400)
    assert [(p.pid, p.cmdline) for p in open_processes(engine)] == [
        (41, ["llama-server", "-m", "q"]),
        (42, ["x"]),
    ]
    with engine.connect() as conn:
        position = conn.exec_driver_sql("SELECT seq FROM projection_position").scalar()
    assert position == seqs[1] == last_seq(engine)
    engine.dispose()


async def test_a_refused_write_is_kept_and_stored_in_order_once_the_database_accepts(
    tmp_path: Path,
) -> None:
    """What was measured: a refused batch was logged as "events not stored" and
    dropped, so the live state stayed ahead of the log for good."""
    engine = open_database(tmp_path / "events.db")
    read_only = False

    @sa_event.listens_for(engine, "begin")
    def _query_only(conn: Any) -> None:
        # After engine.py's BEGIN: while set, writes fail as on a read-only disk.
        conn.exec_driver_sql(f"PRAGMA query_only = {int(read_only)}")

    @sa_event.listens_for(engine, "checkin")
    def _writable_again(dbapi_connection: Any, _record: Any) -> None:
        # So the next BEGIN IMMEDIATE on this pooled connection is not refused.
        dbapi_connection.execute("PRAGMA query_only = 0")

    store = SqliteEventStore(engine)
    changes: list[str | None] = []
    store.on_change(lambda: changes.append(store.failure))
    store.start()
    await store.append([enqueued("a")])

    read_only = True
    b = store.submit([enqueued("b")])
    c = store.submit([enqueued("c")])
    await wait_until(lambda: store.failure is not None)
    assert "readonly" in (store.failure or "") and store.retry_in > 0
    assert not b.done() and not c.done()  # kept, not failed
    d = store.submit([enqueued("d")])  # submitted while refused: after b and c

    read_only = False
    assert await asyncio.wait_for(asyncio.gather(b, c, d), 10) == [[2], [3], [4]]
    assert store.failure is None
    assert len(changes) == 2 and changes[1] is None and "readonly" in (changes[0] or "")
    await store.close()
    ids = [e.request_id for _, e in read_events(engine)]  # type: ignore[union-attr]
    assert ids == ["a", "b", "c", "d"]
    engine.dispose()


async def test_close_gives_up_on_a_database_that_still_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(event_store, "CLOSE_RETRY_S", 0.3)
    engine = open_database(tmp_path / "events.db")

    @sa_event.listens_for(engine, "begin")
    def _query_only(conn: Any) -> None:
        conn.exec_driver_sql("PRAGMA query_only = 1")

    store = SqliteEventStore(engine)
    store.start()
    kept = store.submit([enqueued("a")])
    await wait_until(lambda: store.failure is not None)
    await store.close()  # returns, does not retry forever
    with pytest.raises(StoreError, match="not stored"):
        await kept
    engine.dispose()


@pytest.mark.parametrize(("synchronous", "level"), [("full", 2), ("normal", 1)])
def test_pragmas(tmp_path: Path, synchronous: Any, level: int) -> None:
    engine = open_database(tmp_path / "events.db", synchronous=synchronous)
    with engine.connect() as conn:

        def pragma(name: str) -> Any:
            return conn.exec_driver_sql(f"PRAGMA {name}").scalar()

        assert pragma("journal_mode") == "wal"
        assert pragma("synchronous") == level
        assert pragma("busy_timeout") == 5000
        assert pragma("foreign_keys") == 1
    engine.dispose()


def test_an_unknown_synchronous_setting_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'fast'"):
        create_engine(tmp_path / "x.db", synchronous="fast")  # type: ignore[arg-type]


# -- files that are not a usable gpulane database --------------------------------------------


def _migrated(path: Path) -> Engine:
    """A real gpulane database, several pages long."""
    engine = open_database(path)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE padding (x)")
        conn.exec_driver_sql("INSERT INTO padding VALUES (?)", [(b"p" * 900,)] * 100)
    return engine


def _random_file(path: Path) -> None:
    path.write_bytes(os.urandom(8192))


def _corrupt_sqlite(path: Path) -> None:
    _migrated(path).dispose()
    with path.open("r+b") as f:  # keep the header, wreck the schema page and beyond
        f.seek(100)
        f.write(os.urandom(16384))


def _foreign_sqlite(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, total REAL)")


def _newer_schema(path: Path) -> None:
    engine = _migrated(path)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '0999_from_the_future'")
    engine.dispose()


def _directory(path: Path) -> None:
    path.mkdir()


def _in_a_missing_directory(path: Path) -> None:
    path.parent.rmdir()


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (_random_file, "not an SQLite database"),
        (_corrupt_sqlite, "corrupt"),
        (_foreign_sqlite, "not a gpulane database"),
        (_newer_schema, "newer than this gpulane"),
        (_directory, "is a directory"),
        (_in_a_missing_directory, "does not exist"),
    ],
    ids=["random-bytes", "corrupt", "foreign-sqlite", "newer-schema", "directory", "no-dir"],
)
def test_unusable_files_give_a_database_error_naming_the_file(
    tmp_path: Path, make: Any, problem: str
) -> None:
    path = tmp_path / "data" / "gpulane.db"
    path.parent.mkdir()
    make(path)
    with pytest.raises(DatabaseError) as info:
        open_database(path)
    assert str(path) in str(info.value)
    assert problem in str(info.value)


def test_an_empty_file_becomes_a_new_database(tmp_path: Path) -> None:
    path = tmp_path / "gpulane.db"
    path.touch()
    engine = open_database(path)
    assert last_seq(engine) == 0
    engine.dispose()


# -- one bad event, a clean stop, a backup -----------------------------------------------------


async def test_an_event_the_database_cannot_hold_fails_alone_and_its_batch_is_stored(
    database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = database
    engine = open_database(path)
    store = SqliteEventStore(engine)
    store.start()
    await store.append([enqueued("before")])
    # Submitted in one tick, so they reach the writer as one group commit: the bad
    # event sits between other callers' events, past the first insert chunk.
    many = store.submit([enqueued(f"many{i}") for i in range(300)])
    other = store.submit(
        [enqueued("other"), ev.RequestDispatched(at=T0 + 1, request_id="other", model="qwen")]
    )
    bad = store.submit([enqueued("big", priority=2**63, band="interactive")])
    mixed = store.submit([enqueued("mixed"), enqueued("huge", priority=-(2**63) - 1)])
    after = store.submit([enqueued("after")])

    with pytest.raises(
        StoreError, match="request_enqueued of request big not stored.*(too large|out of range)"
    ):
        await bad
    with pytest.raises(StoreError, match="request mixed \\(\\+1 more\\) not stored"):
        await mixed  # a caller's events are stored together or not at all
    seqs = [*await many, *await other, *await after]
    assert seqs == list(range(2, 2 + 303))  # no gaps where the bad events would have been
    assert store.failure is None
    assert await store.append([enqueued("next")]) == [305]
    await store.close()
    engine.dispose()

    stored = [e.request_id for _, e in _read_file(path)]  # type: ignore[union-attr]
    assert stored == [
        "before",
        *(f"many{i}" for i in range(300)),
        "other",
        "other",
        "after",
        "next",
    ]
    assert commands.check(str(path)) == 0
    assert capsys.readouterr().out.startswith("ok: 305 events")


async def test_close_checkpoints_the_wal_so_the_db_file_alone_is_complete(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    engine = open_database(path)
    # Another open connection: SQLite's own checkpoint when the last one closes
    # must not be what makes the file whole.
    keeper = sqlite3.connect(path)
    store = SqliteEventStore(engine)
    store.start()
    await store.append([enqueued(f"r{i}") for i in range(50)])
    await store.close()

    copy = tmp_path / "copy" / "events.db"
    copy.parent.mkdir()
    shutil.copyfile(path, copy)  # the .db alone, as a user copies it
    keeper.close()
    engine.dispose()

    with sqlite3.connect(copy) as conn:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
        assert {"events", "requests", "alembic_version"} <= tables
        assert conn.execute("SELECT count(*) FROM events").fetchone() == (50,)
        assert conn.execute("SELECT count(*) FROM requests").fetchone() == (50,)
    assert commands.check(str(copy)) == 0


async def test_db_backup_while_the_store_appends_is_a_consistent_copy(tmp_path: Path) -> None:
    path = tmp_path / "gpulane.db"
    target = tmp_path / "backups" / "copy.db"
    target.parent.mkdir()
    engine = open_database(path)
    store = SqliteEventStore(engine)
    store.start()
    await store.append([enqueued(f"seed{i}") for i in range(500)])
    backup = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "app.cli",
        "db",
        "backup",
        str(target),
        "--db",
        str(path),
        cwd=Path(__file__).parents[2],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    appended_during = 0
    while backup.returncode is None:  # the backup runs under continuous writes
        rid = f"live{appended_during}"
        await store.append(
            [
                enqueued(rid),
                ev.RequestDispatched(at=T0 + 1, request_id=rid, model="qwen"),
                ev.RequestCompleted(at=T0 + 2, request_id=rid, http_status=200),
            ]
        )
        appended_during += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(backup.wait(), 0.001)
    out, err = await backup.communicate()
    assert backup.returncode == 0, err.decode()
    await store.append([enqueued("after")])
    await store.close()
    engine.dispose()

    assert appended_during > 0
    assert out.decode().startswith(f"ok: {path} copied to {target}: ")
    copied, original = _read_file(target), _read_file(path)
    assert 500 <= len(copied) < len(original)
    assert copied == original[: len(copied)]  # a prefix of the log: one commit's snapshot
    assert (len(copied) - 500) % 3 == 0  # never part of a transaction
    assert commands.check(str(target)) == 0
    assert not [p.name for p in target.parent.iterdir() if "partial" in p.name]


def test_db_backup_refuses_to_overwrite_the_database_itself(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gpulane.db"
    open_database(path).dispose()
    assert commands.backup(str(path), str(path)) == 1
    assert "is the database itself" in capsys.readouterr().err
    assert commands.backup(str(path), str(tmp_path)) == 1
    assert "is a directory" in capsys.readouterr().err
    assert commands.backup(str(tmp_path / "missing.db"), str(tmp_path / "x.db")) == 1
    assert "no such database file" in capsys.readouterr().err


def _read_file(path: Path | str) -> list[tuple[int, ev.AnyEvent]]:
    engine = open_database(path, upgrade=False)
    try:
        return list(read_events(engine))
    finally:
        engine.dispose()


@pytest.mark.postgres
async def test_postgres_a_refused_write_is_kept_and_stored_in_order_once_it_is_accepted(
    postgres_url: str,
) -> None:
    """PostgreSQL's refusal here: another transaction holds the log's table, so
    the writer's lock times out (lock_timeout), as a locked SQLite file does."""
    engine = open_database(postgres_url)

    @sa_event.listens_for(engine, "connect")
    def _short_lock_timeout(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.autocommit = True
        dbapi_connection.execute("SET lock_timeout = 100")
        dbapi_connection.autocommit = False

    store = SqliteEventStore(engine)
    changes: list[str | None] = []
    store.on_change(lambda: changes.append(store.failure))
    store.start()
    await store.append([enqueued("a")])

    blocker = psycopg.connect(
        engine.url.render_as_string(hide_password=False).replace("+psycopg", "")
    )
    blocker.execute("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
    b = store.submit([enqueued("b")])
    c = store.submit([enqueued("c")])
    await wait_until(lambda: store.failure is not None)
    assert "lock timeout" in (store.failure or "") and store.retry_in > 0
    assert not b.done() and not c.done()  # kept, not failed
    d = store.submit([enqueued("d")])  # submitted while refused: after b and c

    blocker.rollback()
    blocker.close()
    assert await asyncio.wait_for(asyncio.gather(b, c, d), 10) == [[2], [3], [4]]
    assert store.failure is None
    assert len(changes) == 2 and changes[1] is None
    await store.close()
    ids = [e.request_id for _, e in read_events(engine)]  # type: ignore[union-attr]
    assert ids == ["a", "b", "c", "d"]
    engine.dispose()


@pytest.mark.postgres
async def test_postgres_a_lost_connection_loses_nothing_and_the_writer_reconnects(
    postgres_url: str,
) -> None:
    """The server ended every connection (a restart, a failover of the database,
    an administrator): the writer keeps what it was given and writes it on a new one."""
    engine = open_database(postgres_url)
    store = SqliteEventStore(engine)
    store.start()
    await store.append([enqueued("a")])
    with psycopg.connect(postgres_url.replace("+psycopg", ""), autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    assert await asyncio.wait_for(store.append([enqueued("b"), enqueued("c")]), 10) == [2, 3]
    assert store.failure is None
    await store.close()
    assert [e.request_id for _, e in read_events(engine)] == ["a", "b", "c"]  # type: ignore[union-attr]
    engine.dispose()
