"""Opening the database: SQLite (a file, the default) or PostgreSQL (an SQLAlchemy
URL, `postgresql+psycopg://...`): per-connection settings, the startup checks
and the upgrade to head; and the read-only open of tools that must not change
their input.

A database is named by a plain path or an SQLAlchemy URL (`database_url`).
SQLite's checks of the file (its header, `PRAGMA quick_check`, immutable
opens) have no PostgreSQL counterpart to run: the server owns its files and
checks its pages itself (data checksums, `pg_amcheck`). What both share: the
schema must be gpulane's at a known revision, the database must be writable
(`check_writable`), and a writer takes the write lock up front
(`sqlite_begin="IMMEDIATE"`: BEGIN IMMEDIATE on SQLite, `LOCK TABLE events`
on PostgreSQL, so seqs stay gap-free and one writer appends at a time).

Every failure to open is a `DatabaseError` whose message names the file and
the problem, because the person reading it is deciding what to do with that file;
for a damaged file it also says what to do (`corrupt`). `unusable` turns an error
raised later, while reading, into the same sentence.
"""

from __future__ import annotations

import os
import sqlite3
import time
import urllib.parse
from pathlib import Path
from typing import Any, Final, Literal

import psycopg
import sqlalchemy
from sqlalchemy import event
from sqlalchemy.engine import URL, Engine

from app.store import migrate
from app.store.cursor import to_psycopg

Synchronous = Literal["full", "normal"]

SQLITE_MAGIC = b"SQLite format 3\x00"

BUSY_TIMEOUT_MS: Final = 5000
"""How long any statement waits for another connection's lock before failing."""

STARTUP_WRITE_WAIT_S: Final = 5.0
"""How long start-up waits for another writer to let go before refusing the file."""


WAL_SIZE_LIMIT: Final = 4 * 1024 * 1024
"""Bytes the write-ahead log keeps after a checkpoint (about SQLite's 1000-page
autocheckpoint, so the usual log is never cut)."""


QUICK_CHECK_ROWS: Final = 10
"""Problems `PRAGMA quick_check` reports before it stops looking."""

RESTORE_ADVICE: Final = (
    "Restore the latest copy made by `gpulane db backup` (`gpulane db check --db COPY` "
    "tells whether a copy is whole) and keep the damaged file aside."
)
"""What to do with a damaged database, said by every command that finds one."""


WRITE_LOCK: Final = "LOCK TABLE events IN SHARE ROW EXCLUSIVE MODE"
"""PostgreSQL's BEGIN IMMEDIATE: one writer at a time, readers never blocked."""


class DatabaseError(Exception):
    """The database cannot be used; the message says which one and why."""


def database_url(db: str | os.PathLike[str]) -> URL:
    """The SQLAlchemy URL of `db`: an URL as given (`sqlite:///PATH`,
    `postgresql+psycopg://USER@HOST/NAME`), anything else a path to an SQLite file.

    Raises DatabaseError for a URL of a database gpulane does not run on."""
    text = os.fspath(db)
    if "://" not in text:
        return URL.create("sqlite", database=text)
    try:
        url = sqlalchemy.make_url(text)
    except sqlalchemy.exc.ArgumentError as exc:
        raise DatabaseError(f"{shown(text)}: not a database URL ({exc})") from exc
    if url.get_backend_name() == "postgresql":
        # psycopg (3) is the driver gpulane ships with; `postgresql://` means it too.
        return url.set(drivername="postgresql+psycopg")
    if url.get_backend_name() != "sqlite":
        raise DatabaseError(
            f"{shown(text)}: gpulane's log runs on SQLite (a path, or sqlite:///PATH) or "
            "PostgreSQL (postgresql+psycopg://USER@HOST:PORT/NAME), not "
            f"{url.get_backend_name()}"
        )
    return url


def is_sqlite(db: str | os.PathLike[str]) -> bool:
    return database_url(db).get_backend_name() == "sqlite"


def shown(db: str | os.PathLike[str] | URL) -> str:
    """How messages name a database: its path, or its URL without the password."""
    if isinstance(db, URL):
        url = db
    else:
        text = os.fspath(db)
        if "://" not in text:
            return text
        try:
            url = sqlalchemy.make_url(text)
        except sqlalchemy.exc.ArgumentError:
            return text.split("@")[-1]
    if url.get_backend_name() == "sqlite":
        return url.database or ":memory:"
    return url.render_as_string(hide_password=True)


def corrupt(path: str | Path, detail: str) -> DatabaseError:
    """The sentence for a damaged file: which file, what is wrong, what to do."""
    return DatabaseError(f"{path}: the database file is corrupt ({detail}). {RESTORE_ADVICE}")


def unusable(path: str | Path, exc: BaseException) -> DatabaseError | None:
    """The `DatabaseError` for an error raised while opening or reading the database
    at `path`, or None when `exc` is not about the file (a bug should keep its traceback).

    SQLite reports damage as SQLITE_CORRUPT or SQLITE_NOTADB; text that is not
    UTF-8 where the schema or a row should be comes out of the sqlite3 module as
    "Could not decode to UTF-8", or as a UnicodeDecodeError when SQLite's own
    error message quotes the damaged bytes.
    """
    if isinstance(exc, DatabaseError):
        return exc
    if isinstance(exc, UnicodeDecodeError):
        return corrupt(path, "its schema or a row holds bytes that are not UTF-8 text")
    cause = exc.orig if isinstance(exc, sqlalchemy.exc.DBAPIError) else exc
    if isinstance(cause, psycopg.Error):
        return _postgres_problem(path, cause)
    if not isinstance(cause, sqlite3.DatabaseError):
        return None
    text = str(cause)
    name = getattr(cause, "sqlite_errorname", "") or ""
    if name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")) or type(cause) is sqlite3.DatabaseError:
        return corrupt(path, f"SQLite: {text}")
    if not isinstance(cause, sqlite3.OperationalError):
        return None  # IntegrityError, ProgrammingError, ...: gpulane's own mistake
    if "Could not decode" in text:
        return corrupt(path, f"SQLite: {text}")
    if "no such table" in text or "no such column" in text:
        return DatabaseError(
            f"{path}: its schema is not what this gpulane reads (SQLite: {text}). "
            f"`gpulane db check --db {path}` tells whether it is damaged (then restore the "
            "latest copy made by `gpulane db backup`) or from an older gpulane (then run "
            f"`gpulane db upgrade --db {path}`)."
        )
    return DatabaseError(f"{path}: {_access_problem(cause)} ({describe(cause)})")


def _postgres_problem(db: str | Path, cause: psycopg.Error) -> DatabaseError | None:
    if isinstance(cause, psycopg.errors.UndefinedTable | psycopg.errors.UndefinedColumn):
        return DatabaseError(
            f"{shown(db)}: its schema is not what this gpulane reads (PostgreSQL: {cause}). "
            f"`gpulane db upgrade --db {shown(db)}` brings a database of an older gpulane up "
            "to date."
        )
    if isinstance(
        cause, psycopg.errors.InsufficientPrivilege | psycopg.errors.ReadOnlySqlTransaction
    ):
        return DatabaseError(
            f"{shown(db)}: the database cannot be written ({describe(cause)}); gpulane "
            "records every decision and needs a role that may write, on the primary"
        )
    if isinstance(cause, psycopg.errors.LockNotAvailable):
        return DatabaseError(
            f"{shown(db)}: the log is locked by another writer (another gpulane, "
            f"`gpulane db rebuild` or an open transaction); gave up after "
            f"{BUSY_TIMEOUT_MS / 1000:g} s"
        )
    if isinstance(cause, psycopg.OperationalError | psycopg.InterfaceError):
        return DatabaseError(f"{shown(db)}: cannot use PostgreSQL ({describe(cause)})")
    return None  # gpulane's own mistake: keep the traceback


def check_pages(conn: sqlalchemy.Connection, path: str | Path) -> None:
    """`PRAGMA quick_check`: every page of every table and index is well formed.

    Reads the whole file (113 MB: 0.09 s from the page cache, 2.2 s from a cold
    52 MB/s disk; docs/events.md); raises `corrupt` with SQLite's first finding.
    """
    problems = [
        str(row[0]) for row in conn.exec_driver_sql(f"PRAGMA quick_check({QUICK_CHECK_ROWS})")
    ]
    if problems != ["ok"]:
        more = f", and {len(problems) - 1} more" if len(problems) > 1 else ""
        raise corrupt(path, f"PRAGMA quick_check: {problems[0]}{more}")


def create_engine(db: str | Path, synchronous: Synchronous = "full") -> Engine:
    """An engine for the database `db` (a path or URL, `database_url`), with
    gpulane's settings on every connection.

    Does not check or migrate the database; `open_database` does.
    """
    if synchronous not in ("full", "normal"):
        raise ValueError(f"synchronous: {synchronous!r} is not one of 'full', 'normal'")
    url = database_url(db)
    if url.get_backend_name() != "sqlite":
        return _postgres_engine(url, synchronous)
    engine = sqlalchemy.create_engine(url)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: sqlite3.Connection, _record: Any) -> None:
        # Let SQLAlchemy (below) issue BEGIN instead of the sqlite3 module's
        # implicit transactions, so DDL and reads are transactional too.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        _use_wal(cursor)
        # A large job body passes through the WAL; cut it back after the checkpoint,
        # so the body takes its size on disk once, not twice (app/store/job_bodies.py).
        cursor.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
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


def _use_wal(cursor: sqlite3.Cursor) -> None:
    """PRAGMA journal_mode = WAL, retried for as long as busy_timeout: SQLite does not
    wait for the lock that turning a new file to WAL takes, so two servers opening a
    new file at once saw "database is locked"."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _postgres_engine(url: URL, synchronous: Synchronous, read_only: bool = False) -> Engine:
    """SQLite's settings, said to PostgreSQL: a lock is waited for as long as
    busy_timeout; `synchronous: normal` (a crash may lose the last commits, never
    corrupt) is synchronous_commit off; a reader's transactions are read-only."""
    settings = {
        "lock_timeout": str(BUSY_TIMEOUT_MS),
        "synchronous_commit": "on" if synchronous == "full" else "off",
        "default_transaction_read_only": "on" if read_only else "off",
    }
    options = " ".join(f"-c {name}={value}" for name, value in settings.items())
    engine = sqlalchemy.create_engine(
        url,
        pool_pre_ping=True,
        connect_args={"options": options, "application_name": "gpulane", "connect_timeout": 10},
    )

    @event.listens_for(engine, "begin")
    def _on_begin(connection: sqlalchemy.Connection) -> None:
        if connection.get_execution_options().get("sqlite_begin") == "IMMEDIATE":
            connection.exec_driver_sql(WRITE_LOCK)

    @event.listens_for(engine, "before_cursor_execute", retval=True)
    def _placeholders(
        _conn: Any, _cursor: Any, statement: str, parameters: Any, context: Any, _many: bool
    ) -> tuple[str, Any]:
        # SQL run as it is (exec_driver_sql) is written in sqlite3's placeholders,
        # as the writer's is (cursor.py); what SQLAlchemy compiled is psycopg's already.
        if context is not None and context.compiled is None:
            statement = to_psycopg(statement)
        return statement, parameters

    return engine


def _open_postgres(url: URL, synchronous: Synchronous, upgrade: bool) -> Engine:
    """open_database for PostgreSQL: the same schema checks and upgrade, and a
    test write; page checks are the server's own."""
    engine = _postgres_engine(url, synchronous)
    try:
        with engine.connect() as conn:
            _check_schema(conn, url)
        if upgrade:
            migrate.upgrade_to_head(engine)
            check_writable(engine, url)
    except (sqlalchemy.exc.DBAPIError, psycopg.Error) as exc:
        engine.dispose()
        problem = unusable(shown(url), exc)
        raise problem or DatabaseError(
            f"{shown(url)}: cannot use the database ({describe(exc)})"
        ) from exc
    except DatabaseError:
        engine.dispose()
        raise
    return engine


def _check_schema(conn: sqlalchemy.Connection, db: str | Path | URL) -> None:
    """Refuse another application's database, or one of a newer gpulane."""
    tables = set(sqlalchemy.inspect(conn).get_table_names())
    if tables and not {"alembic_version", "events"} <= tables:
        raise DatabaseError(
            f"{shown(db)}: not a gpulane database (it has tables "
            f"{', '.join(sorted(tables))} but no alembic_version/events)"
        )
    revision = migrate.current_revision(conn)
    if revision is not None and not migrate.is_known_revision(revision):
        raise DatabaseError(
            f"{shown(db)}: schema revision {revision!r} is newer than this gpulane "
            f"knows (latest {migrate.head_revision()!r}); upgrade gpulane"
        )


def open_database(
    db: str | Path, synchronous: Synchronous = "full", upgrade: bool = True
) -> Engine:
    """Check the database `db` (a path or URL, `database_url`), migrate it to the
    latest schema and return its engine. On SQLite:

    A missing or empty file becomes a new database. `upgrade=False` only checks
    (for tools that must not change the file); otherwise the file must also
    be writable now (`check_writable`), because a server that cannot record
    its decisions must not start, and every page must be well formed
    (`check_pages`), so nothing is written into a damaged file. Raises
    `DatabaseError` for a file that is not SQLite, corrupt, another application's
    database, from a newer gpulane, read-only, or locked by another writer for
    longer than STARTUP_WRITE_WAIT_S. On PostgreSQL, `_open_postgres`.
    """
    url = database_url(db)
    if url.get_backend_name() != "sqlite":
        return _open_postgres(url, synchronous, upgrade)
    path = url.database or ""
    check_file(path)
    engine = create_engine(path, synchronous)
    try:
        with engine.connect() as conn:
            _check_schema(conn, path)
            if upgrade:
                check_pages(conn, path)
        if upgrade:
            migrate.upgrade_to_head(engine)
            check_writable(engine, path)
    except (sqlalchemy.exc.DBAPIError, sqlite3.Error, UnicodeDecodeError) as exc:
        engine.dispose()
        problem = unusable(path, exc)
        raise problem or DatabaseError(
            f"{path}: cannot use the database ({describe(exc)})"
        ) from exc
    except DatabaseError:
        engine.dispose()
        raise
    return engine


def open_readonly(db: str | Path) -> Engine:
    """An engine that can only read the database `db` (a path or URL), for tools
    whose input must never be modified (`gpulane replay`, `gpulane ui --db`).
    Neither migrates nor sets pragmas. On PostgreSQL every transaction is read-only.

    A file with no write-ahead log (`-wal`) or rollback journal beside it holds
    the whole database (a `gpulane db backup` copy, a file gpulane closed cleanly):
    it is opened `immutable=1`, so SQLite creates no `-wal` or `-shm` beside it and
    takes no lock, and it reads in a read-only directory. A file with a log beside
    it may be served right now, or hold commits only in that log: it is opened
    `mode=ro`, which reads them through a `-shm` index beside it (created if absent).
    Every page is checked (`check_pages`).

    Raises `DatabaseError` for a missing file, one that is not SQLite or is
    corrupt, a database without an `events` table, or one whose log cannot be read.
    """
    url = database_url(db)
    if url.get_backend_name() != "sqlite":
        return _open_postgres_readonly(url)
    path = url.database or ""
    p = Path(path)
    if not p.is_file():
        raise DatabaseError(no_such_database(path))
    check_file(p)
    logs = [log for log in (_beside(p, "-wal"), _beside(p, "-journal")) if log.exists()]
    options = "mode=ro" if logs else "mode=ro&immutable=1"
    uri = "file:" + urllib.parse.quote(str(p.resolve())) + "?" + options
    engine = sqlalchemy.create_engine("sqlite:///" + uri + "&uri=true")
    try:
        with engine.connect() as conn:
            names = set(sqlalchemy.inspect(conn).get_table_names())
            if "events" in names:
                check_pages(conn, path)
    except (sqlalchemy.exc.DBAPIError, sqlite3.Error, UnicodeDecodeError) as exc:
        engine.dispose()
        if logs and "unable to open" in str(exc):
            raise DatabaseError(
                f"{path}: cannot be read without writing beside it: {logs[0]} holds changes "
                "that may not be in the file yet (a gpulane is serving it, or stopped without "
                f"a checkpoint), and reading them needs {_beside(p, '-shm')}, which cannot be "
                f"created there. Copy {p.name} and {logs[0].name} together into a writable "
                "directory and open the copy, or open a copy made by `gpulane db backup`."
            ) from exc
        problem = unusable(path, exc)
        raise problem or DatabaseError(
            f"{path}: cannot use the database ({describe(exc)})"
        ) from exc
    except DatabaseError:
        engine.dispose()
        raise
    if "events" not in names:
        engine.dispose()
        raise DatabaseError(f"{path}: not a gpulane database (no events table)")
    return engine


def _open_postgres_readonly(url: URL) -> Engine:
    engine = _postgres_engine(url, "full", read_only=True)
    try:
        with engine.connect() as conn:
            names = set(sqlalchemy.inspect(conn).get_table_names())
    except (sqlalchemy.exc.DBAPIError, psycopg.Error) as exc:
        engine.dispose()
        problem = unusable(shown(url), exc)
        raise problem or DatabaseError(f"{shown(url)}: cannot use the database") from exc
    if "events" not in names:
        engine.dispose()
        raise DatabaseError(f"{shown(url)}: not a gpulane database (no events table)")
    return engine


def _beside(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def check_writable(engine: Engine, path: str | Path | URL) -> None:
    """Take the write lock and try a write, then roll back: nothing changes on disk.

    Waits at most STARTUP_WRITE_WAIT_S for another writer; raises DatabaseError
    for a locked or read-only (or immutable) file. On PostgreSQL, the same write
    finds a role without the right or a read-only server (a hot standby).
    """
    if engine.dialect.name != "sqlite":
        with engine.connect() as conn, conn.begin() as transaction:
            conn.exec_driver_sql("UPDATE alembic_version SET version_num = version_num WHERE false")
            transaction.rollback()
        return
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


def refused_by_disk(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is the disk refusing a write: full, or an
    I/O error (SQLite cannot create the shared-memory index of a file it opens
    on a full disk, and says so). Space can come back, so a server waits for
    it; a damaged, locked or read-only database is another matter."""
    seen: BaseException | None = exc
    for _ in range(8):  # the chain is short: DatabaseError <- SQLAlchemy's <- the driver's
        if seen is None:
            return False
        cause = seen.orig if isinstance(seen, sqlalchemy.exc.DBAPIError) else seen
        if isinstance(cause, sqlite3.OperationalError):
            name = getattr(cause, "sqlite_errorname", "") or ""
            return name.startswith(("SQLITE_FULL", "SQLITE_IOERR"))
        if isinstance(cause, psycopg.errors.DiskFull):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def describe(exc: BaseException) -> str:
    """An error in the database's own words, without SQLAlchemy's wrapping and links."""
    cause = exc.orig if isinstance(exc, sqlalchemy.exc.DBAPIError) else exc
    return f"{type(cause).__name__}: {cause}"


def check_file(path: str | Path) -> None:
    """Refuse a file that is not SQLite, or one cut short, before SQLite (and WAL
    mode) touch it."""
    p = Path(path)
    if p.is_dir():
        raise DatabaseError(f"{path}: is a directory, not an SQLite database")
    if not p.parent.is_dir():
        raise DatabaseError(f"{path}: directory {p.parent} does not exist")
    if not p.exists() or (size := p.stat().st_size) == 0:
        return
    with p.open("rb") as f:
        header = f.read(HEADER_SIZE)
    if header[: len(SQLITE_MAGIC)] != SQLITE_MAGIC:
        raise DatabaseError(
            f"{path}: not an SQLite database (the file header is wrong). If that is the right "
            f"path, the file is damaged: {RESTORE_ADVICE[0].lower()}{RESTORE_ADVICE[1:]}"
        )
    expected = _size_in_header(header)
    wal = _beside(p, "-wal")
    # With a log beside it (a checkpoint under way, a hot rollback journal) the file
    # may lag its header until the log is applied; alone, it must hold every page
    # its header counts.
    logged = (wal.exists() and wal.stat().st_size > 0) or _beside(p, "-journal").exists()
    if size < expected and not logged:
        raise corrupt(path, f"cut short: {size} bytes, where its header counts {expected}")


HEADER_SIZE: Final = 100
"""Bytes of the SQLite file header (sqlite.org/fileformat.html, 1.3)."""


def _size_in_header(header: bytes) -> int:
    """The file size the SQLite header states, or 0 where it states none it stands by."""
    if len(header) < HEADER_SIZE:
        return HEADER_SIZE
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    # The page count is valid only if written by the same change as the counter.
    if header[24:28] != header[92:96]:
        return 0
    return page_size * pages


def no_such_database(path: str | os.PathLike[str]) -> str:
    """What a command says when the database it was given is not there: a user
    in another directory than the server's needs `--db`."""
    if not is_sqlite(path):
        return f"{shown(path)}: no such database"
    where = os.path.abspath(path)
    return (
        f"{path}: no such database file ({where}); name the server's database with "
        "--db PATH (its config's database.path, gpulane.db in the directory it was "
        "started from by default)"
    )
