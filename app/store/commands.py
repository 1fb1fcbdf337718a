"""`gpulane db upgrade | rebuild | check | backup | copy`: each takes databases
(a path or an SQLAlchemy URL, `engine.database_url`) and returns 0 or 1."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import sys
from itertools import islice
from pathlib import Path

import msgspec
import psycopg
import sqlalchemy
from sqlalchemy import Table, func, select
from sqlalchemy.engine import Engine

from app.core.events import AnyEvent, decode
from app.store import migrate, read_model
from app.store.cursor import driver_cursor, pipelined
from app.store.engine import (
    QUICK_CHECK_ROWS,
    DatabaseError,
    corrupt,
    database_url,
    describe,
    is_sqlite,
    no_such_database,
    open_database,
    shown,
    unusable,
)
from app.store.event_store import event_rows
from app.store.invariants import LogAudit
from app.store.job_bodies import open_jobs_without_body
from app.store.log_copy import CopyRefused, copy_log
from app.store.tables import processes, requests

REBUILD_BATCH = 5000
"""Events decoded and projected per step of a rebuild."""


def upgrade(path: str) -> int:
    """Migrate the database (creating it if missing) to the latest schema."""
    try:
        engine = open_database(path)
    except DatabaseError as exc:
        return _fail(exc)
    with engine.connect() as conn:
        print(f"ok: {shown(path)} at schema revision {migrate.current_revision(conn)}")
    engine.dispose()
    return 0


def rebuild(path: str) -> int:
    """Recompute every read model from `events`, in one transaction (all or nothing).

    Holds the write lock throughout; a running server's writes wait for it.
    """
    try:
        engine = _open_existing(path, upgrade=True)
    except DatabaseError as exc:
        return _fail(exc)
    count = 0
    try:
        with engine.connect() as conn:
            conn.execution_options(sqlite_begin="IMMEDIATE")
            with conn.begin():
                cur = driver_cursor(conn)
                read_model.clear(cur)
                rows = event_rows(conn)
                while batch := list(islice(rows, REBUILD_BATCH)):
                    with pipelined(cur):
                        count += read_model.project_all(cur, map(_decoded, batch))
        n_requests = _count(engine, requests)
        n_processes = _count(engine, processes)
    except _Undecodable as exc:
        return _fail(DatabaseError(f"{shown(path)}: rebuild failed, nothing changed: {exc}"))
    except (
        sqlalchemy.exc.SQLAlchemyError,
        sqlite3.Error,
        psycopg.Error,
        UnicodeDecodeError,
    ) as exc:
        problem = unusable(path, exc)
        if problem is not None:
            return _fail(DatabaseError(f"rebuild failed, nothing changed: {problem}"))
        return _fail(
            DatabaseError(f"{shown(path)}: rebuild failed, nothing changed: {describe(exc)}")
        )
    finally:
        engine.dispose()
    print(f"ok: rebuilt from {count} events: {n_requests} requests, {n_processes} processes")
    return 0


class _Undecodable(Exception):
    def __init__(self, seq: int, reason: str) -> None:
        super().__init__(f"seq {seq}: cannot decode: {reason}")
        self.seq = seq
        self.reason = f"cannot decode: {reason}"


def _decoded(row: tuple[int, str]) -> tuple[int, AnyEvent]:
    seq, data = row
    try:
        return seq, decode(data)
    except msgspec.MsgspecError as exc:
        raise _Undecodable(seq, str(exc)) from exc


def check(path: str) -> int:
    """SQLite's integrity check, the schema against gpulane's (at the latest
    revision), then the event invariants; exit 1 on any failure.

    PostgreSQL has no integrity check to run from a connection: the server
    checks its own pages (data checksums; `pg_amcheck` for a full check)."""
    try:
        engine = _open_existing(path, upgrade=False)
    except DatabaseError as exc:
        return _fail(exc)
    try:
        with engine.connect() as conn:
            problems = ["ok"]
            if conn.dialect.name == "sqlite":
                problems = [row[0] for row in conn.exec_driver_sql("PRAGMA integrity_check")]
            if problems != ["ok"]:
                for finding in problems:
                    print(f"integrity: {finding}")
                return _fail(corrupt(path, "PRAGMA integrity_check, as listed above"))
            if migrate.current_revision(conn) == migrate.head_revision():
                differences = migrate.schema_differences(conn)
                for difference in differences:
                    print(f"schema: {difference}")
                if differences:
                    return _fail(
                        corrupt(path, "its schema is not the one gpulane creates, as listed above")
                    )
            audit = LogAudit()
            for row in event_rows(conn):
                try:
                    audit.feed(*_decoded(row))
                except _Undecodable as exc:
                    audit.flag(exc.seq, exc.reason)
            for rid in open_jobs_without_body(conn):
                audit.flag(0, f"job {rid} is open but its body is missing (job_bodies)")
    except (sqlalchemy.exc.DBAPIError, sqlite3.Error, psycopg.Error, UnicodeDecodeError) as exc:
        problem = unusable(path, exc)
        if problem is None:
            raise
        return _fail(problem)
    finally:
        engine.dispose()
    for violation in audit.violations:
        print(f"seq {violation.seq}: {violation.message}")
    if audit.violations:
        print(f"failed: {len(audit.violations)} violations in {audit.events} events")
        return 1
    print(f"ok: {audit.events} events, {audit.requests} requests")
    return 0


def backup(path: str, target: str) -> int:
    """A consistent copy of the database at `target`, safe while gpulane is serving.

    SQLite's online backup copies every page in one step, under one read
    snapshot: the copy is the database as of one commit, and in WAL mode the
    server keeps writing meanwhile. The copy is written next to `target` and
    renamed over it at the end, so a failed backup leaves any older copy whole.
    The copy must pass `PRAGMA quick_check` first: a damaged database makes no
    backup (the pages are copied as they are, damage included).
    """
    if not is_sqlite(path):
        return _fail(
            DatabaseError(
                f"{shown(path)}: `gpulane db backup` copies SQLite files; back PostgreSQL up with "
                f"its own tools: `pg_dump --format=custom --file={target} DBNAME` (restore with "
                "pg_restore), or continuous archiving for point-in-time recovery; "
                f"`gpulane db copy {shown(path)} {target}` makes an SQLite copy of the log"
            )
        )
    dest = Path(target)
    if dest.is_dir():
        return _fail(DatabaseError(f"{target}: is a directory; name the backup file"))
    if not dest.parent.is_dir():
        return _fail(DatabaseError(f"{target}: directory {dest.parent} does not exist"))
    if dest.exists() and dest.resolve() == Path(path).resolve():
        return _fail(DatabaseError(f"{target}: is the database itself; name another file"))
    try:
        engine = _open_existing(path, upgrade=False)
    except DatabaseError as exc:
        return _fail(exc)
    partial = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    try:
        raw = engine.raw_connection()
        try:
            source = raw.driver_connection
            assert isinstance(source, sqlite3.Connection)
            with contextlib.closing(sqlite3.connect(partial)) as copy:
                # pages=-1: all at once. Step-wise copying restarts whenever
                # another connection writes, so under load it might never end.
                source.backup(copy, pages=-1)
                checked = copy.execute(f"PRAGMA quick_check({QUICK_CHECK_ROWS})").fetchall()
                if [row[0] for row in checked] != ["ok"]:
                    raise corrupt(path, f"PRAGMA quick_check: {checked[0][0]}")
                events, last = copy.execute("SELECT count(*), max(seq) FROM events").fetchone()
        finally:
            raw.close()
        os.replace(partial, dest)
        _fsync_directory(dest.parent)
    except (
        sqlalchemy.exc.SQLAlchemyError,
        sqlite3.Error,
        OSError,
        UnicodeDecodeError,
        DatabaseError,
    ) as exc:
        _remove_partial(partial)
        problem = None if isinstance(exc, OSError) else unusable(path, exc)
        if problem is not None:
            return _fail(DatabaseError(f"no backup written to {target}: {problem}"))
        return _fail(DatabaseError(f"{path}: backup to {target} failed: {describe(exc)}"))
    finally:
        engine.dispose()
    print(f"ok: {path} copied to {target}: {events} events (last seq {last or 0})")
    return 0


def _remove_partial(partial: Path) -> None:
    for leftover in (partial, *(partial.with_name(partial.name + x) for x in ("-wal", "-shm"))):
        leftover.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    # So the rename itself survives a power loss, not just the file's contents.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_existing(path: str, upgrade: bool) -> Engine:
    url = database_url(path)
    if url.get_backend_name() == "sqlite" and not Path(url.database or "").is_file():
        raise DatabaseError(no_such_database(path))
    return open_database(path, upgrade=upgrade)


def _count(engine: Engine, table: Table) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def _fail(exc: DatabaseError) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return 1


def copy(source: str, target: str) -> int:
    """Copy the whole log at `source` into the new database `target` (app/store/log_copy.py)."""
    if database_url(source) == database_url(target):
        return _fail(DatabaseError(f"{shown(target)}: is the database itself; name another"))
    try:
        source_engine = _open_existing(source, upgrade=False)
    except DatabaseError as exc:
        return _fail(exc)
    try:
        with source_engine.connect() as conn:
            revision = migrate.current_revision(conn)
        if revision != migrate.head_revision():
            raise DatabaseError(
                f"{shown(source)}: schema revision {revision!r}, not the latest "
                f"({migrate.head_revision()!r}); run `gpulane db upgrade --db {shown(source)}` "
                "first"
            )
        target_engine = open_database(target)
        try:
            copied = copy_log(source_engine, target_engine)
        finally:
            target_engine.dispose()
    except CopyRefused as exc:
        return _fail(DatabaseError(f"{shown(target)}: no copy made: {exc}"))
    except DatabaseError as exc:
        return _fail(exc)
    except (sqlalchemy.exc.SQLAlchemyError, sqlite3.Error, psycopg.Error) as exc:
        return _fail(
            DatabaseError(f"no copy made from {shown(source)} to {shown(target)}: {describe(exc)}")
        )
    finally:
        source_engine.dispose()
    print(
        f"ok: {shown(source)} copied to {shown(target)}: {copied.events} events "
        f"(last seq {copied.last_seq}), {copied.rows} rows in all"
    )
    return 0
