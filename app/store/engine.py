"""Opening the SQLite database: pragmas, the startup checks and the upgrade to head;
and the read-only open of tools that must not change their input.

Every failure to open is a `DatabaseError` whose message names the file and
the problem, because the person reading it is deciding what to do with that file.
"""

from __future__ import annotations

import sqlite3
import urllib.parse
from pathlib import Path
from typing import Any, Final, Literal

import sqlalchemy
from sqlalchemy import event
from sqlalchemy.engine import Engine

from app.store import migrate

Synchronous = Literal["full", "normal"]

SQLITE_MAGIC = b"SQLite format 3\x00"

BUSY_TIMEOUT_MS: Final = 5000
"""How long any statement waits for another connection's lock before failing."""

STARTUP_WRITE_WAIT_S: Final = 5.0
"""How long start-up waits for another writer to let go before refusing the file."""


class DatabaseError(Exception):
    """The database file cannot be used; the message says which file and why."""


def create_engine(path: str | Path, synchronous: Synchronous = "full") -> Engine:
    """An engine for the SQLite file at `path`, with gpulane's pragmas on every connection.

    Does not check or migrate the file; `open_database` does.
    """
    if synchronous not in ("full", "normal"):
        raise ValueError(f"synchronous: {synchronous!r} is not one of 'full', 'normal'")
    engine = sqlalchemy.create_engine(f"sqlite:///{path}")

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: sqlite3.Connection, _record: Any) -> None:
        # Let SQLAlchemy (below) issue BEGIN instead of the sqlite3 module's
        # implicit transactions, so DDL and reads are transactional too.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute(f"PRAGMA synchronous = {synchronous.upper()}")
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: sqlalchemy.Connection) -> None:
        # Writers ask for IMMEDIATE so they take the write lock up front
        # instead of failing with SQLITE_BUSY when a read turns into a write.
        mode = connection.get_execution_options().get("sqlite_begin", "")
        connection.exec_driver_sql(f"BEGIN {mode}".strip())

    return engine


def open_database(
    path: str | Path, synchronous: Synchronous = "full", upgrade: bool = True
) -> Engine:
    """Check the file at `path`, migrate it to the latest schema and return its engine.

    A missing or empty file becomes a new database. `upgrade=False` only checks
    (for tools that must not change the file); otherwise the file must also
    be writable now (`check_writable`), because a server that cannot record
    its decisions must not start. Raises `DatabaseError` for a file that is not
    SQLite, corrupt, another application's database, from a newer gpulane,
    read-only, or locked by another writer for longer than STARTUP_WRITE_WAIT_S.
    """
    check_file(path)
    engine = create_engine(path, synchronous)
    try:
        with engine.connect() as conn:
            tables = set(sqlalchemy.inspect(conn).get_table_names())
            if tables and not {"alembic_version", "events"} <= tables:
                raise DatabaseError(
                    f"{path}: not a gpulane database (it has tables "
                    f"{', '.join(sorted(tables))} but no alembic_version/events)"
                )
            revision = migrate.current_revision(conn)
            if revision is not None and not migrate.is_known_revision(revision):
                raise DatabaseError(
                    f"{path}: schema revision {revision!r} is newer than this gpulane "
                    f"knows (latest {migrate.head_revision()!r}); upgrade gpulane"
                )
        if upgrade:
            migrate.upgrade_to_head(engine)
            check_writable(engine, path)
    except sqlalchemy.exc.DatabaseError as exc:
        engine.dispose()
        # OperationalError is about access (locked, unreadable); its base class
        # is what SQLite raises for a damaged file.
        if isinstance(exc.orig, sqlite3.OperationalError):
            raise DatabaseError(f"{path}: {_access_problem(exc.orig)} ({describe(exc)})") from exc
        raise DatabaseError(
            f"{path}: file is corrupt or not an SQLite database ({describe(exc)})"
        ) from exc
    except DatabaseError:
        engine.dispose()
        raise
    return engine


def open_readonly(path: str | Path) -> Engine:
    """An engine that can only read `path` (SQLite `mode=ro`), for tools whose input
    must never be modified (`gpulane replay`). Neither migrates nor sets pragmas.

    Raises `DatabaseError` for a missing file, one that is not SQLite or is
    corrupt, or a database without an `events` table.
    """
    p = Path(path)
    if not p.is_file():
        raise DatabaseError(f"{path}: no such database file")
    check_file(p)
    uri = "file:" + urllib.parse.quote(str(p.resolve())) + "?mode=ro"
    engine = sqlalchemy.create_engine("sqlite:///" + uri + "&uri=true")
    try:
        with engine.connect() as conn:
            names = set(sqlalchemy.inspect(conn).get_table_names())
    except sqlalchemy.exc.DatabaseError as exc:
        engine.dispose()
        raise DatabaseError(f"{path}: file is corrupt or not an SQLite database ({exc})") from exc
    if "events" not in names:
        engine.dispose()
        raise DatabaseError(f"{path}: not a gpulane database (no events table)")
    return engine


def check_writable(engine: Engine, path: str | Path) -> None:
    """Take the write lock and try a write, then roll back: nothing changes on disk.

    Waits at most STARTUP_WRITE_WAIT_S for another writer; raises DatabaseError
    for a locked or read-only (or immutable) file.
    """
    raw = engine.raw_connection()
    try:
        dbapi = raw.driver_connection
        assert isinstance(dbapi, sqlite3.Connection)
        dbapi.execute(f"PRAGMA busy_timeout = {int(STARTUP_WRITE_WAIT_S * 1000)}")
        try:
            dbapi.execute("BEGIN IMMEDIATE")
            try:
                # A read-only file still grants BEGIN IMMEDIATE in WAL mode; only a
                # write statement (even one that matches no row) is refused.
                dbapi.execute("UPDATE alembic_version SET version_num = version_num WHERE 0")
            finally:
                dbapi.execute("ROLLBACK")
        finally:
            dbapi.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    except sqlite3.OperationalError as exc:
        raise DatabaseError(f"{path}: {_access_problem(exc)} ({describe(exc)})") from exc
    finally:
        raw.close()


def _access_problem(exc: sqlite3.OperationalError) -> str:
    text = str(exc)
    if "locked" in text or "busy" in text:
        return (
            "the database is locked by another writer (another gpulane, `gpulane db rebuild` "
            f"or an open sqlite3 transaction); gave up after {STARTUP_WRITE_WAIT_S:g} s"
        )
    if "readonly" in text or "read-only" in text:
        return (
            "the database cannot be written (read-only or immutable file, or read-only "
            "directory); gpulane records every decision and needs write access"
        )
    return "cannot use the database"


def describe(exc: BaseException) -> str:
    """An error in the database's own words, without SQLAlchemy's wrapping and links."""
    cause = exc.orig if isinstance(exc, sqlalchemy.exc.DBAPIError) else exc
    return f"{type(cause).__name__}: {cause}"


def check_file(path: str | Path) -> None:
    """Refuse a file that is not SQLite before SQLite (and WAL mode) touch it."""
    p = Path(path)
    if p.is_dir():
        raise DatabaseError(f"{path}: is a directory, not an SQLite database")
    if not p.parent.is_dir():
        raise DatabaseError(f"{path}: directory {p.parent} does not exist")
    if not p.exists() or p.stat().st_size == 0:
        return
    with p.open("rb") as f:
        header = f.read(len(SQLITE_MAGIC))
    if header != SQLITE_MAGIC:
        raise DatabaseError(f"{path}: not an SQLite database (the file header is wrong)")
