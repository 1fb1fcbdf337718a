"""The driver's own cursor inside an SQLAlchemy transaction, on either database.

The writer's hot path (`read_model`, `event_store`) runs plain SQL on the
DBAPI cursor: no per-statement SQLAlchemy processing, and the driver caches
prepared statements by their text. Its statements are written once, in
sqlite3's placeholders (`?` and `:name`); on PostgreSQL `PostgresCursor`
rewrites them to psycopg's (`%s`, `%(name)s`) once per statement text, and so
does the engine for SQL run through `exec_driver_sql` (engine.py): hand-written
SQL anywhere in the store takes sqlite3's placeholders on both databases.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sqlite3
from collections.abc import Iterable
from typing import Any, Protocol

import psycopg
import sqlalchemy


class Cursor(Protocol):
    """What gpulane uses of a DBAPI cursor."""

    def execute(self, sql: str, params: Any = ..., /) -> Any: ...

    def executemany(self, sql: str, params: Iterable[Any], /) -> Any: ...

    def fetchone(self) -> Any: ...

    def fetchmany(self, size: int = ..., /) -> list[Any]: ...

    def close(self) -> None: ...


# A quoted string, or a placeholder outside one (`::` is PostgreSQL's cast, not a name).
_TOKEN = re.compile(r"('(?:[^']|'')*')|(\?)|(?<!:):([A-Za-z_]\w*)|(%)")


@functools.lru_cache(maxsize=512)
def to_psycopg(sql: str) -> str:
    """`sql` with sqlite3's placeholders written as psycopg's (and `%` doubled)."""

    def replace(m: re.Match[str]) -> str:
        if m.group(1):
            return m.group(1).replace("%", "%%")
        if m.group(2):
            return "%s"
        if m.group(3):
            return f"%({m.group(3)})s"
        return "%%"

    return _TOKEN.sub(replace, sql)


class PostgresCursor:
    """A psycopg cursor that takes sqlite3's placeholders."""

    def __init__(self, cursor: psycopg.Cursor[Any]) -> None:
        self._cursor = cursor

    def execute(self, sql: str, params: Any = None, /) -> PostgresCursor:
        self._cursor.execute(to_psycopg(sql), params)
        return self

    def executemany(self, sql: str, params: Iterable[Any], /) -> None:
        self._cursor.executemany(to_psycopg(sql), params)

    def fetchone(self) -> Any:
        return self._cursor.fetchone()

    def fetchmany(self, size: int = 1000, /) -> list[Any]:
        return self._cursor.fetchmany(size)

    def fetchall(self) -> list[Any]:
        return self._cursor.fetchall()

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount

    def close(self) -> None:
        self._cursor.close()

    def pipeline(self) -> contextlib.AbstractContextManager[Any]:
        return self._cursor.connection.pipeline()


def pipelined(cur: Cursor) -> contextlib.AbstractContextManager[Any]:
    """Statements sent without waiting for each one's answer (PostgreSQL's pipeline
    mode; an error is raised when the block ends). For statements whose results
    nobody reads: a round trip per statement would cost more than the statement."""
    if isinstance(cur, PostgresCursor):
        return cur.pipeline()
    return contextlib.nullcontext()


def driver_cursor(conn: sqlalchemy.Connection, stream: str | None = None) -> Cursor:
    """The DBAPI cursor inside an SQLAlchemy connection (and its transaction).

    `stream` names a server-side cursor on PostgreSQL, so `fetchmany` reads a
    large result in pieces (sqlite3 always steps through its result)."""
    dbapi = conn.connection.dbapi_connection
    if isinstance(dbapi, sqlite3.Connection):
        return dbapi.cursor()
    assert isinstance(dbapi, psycopg.Connection)
    return PostgresCursor(dbapi.cursor(name=stream) if stream else dbapi.cursor())


def on_sqlite(cur: Cursor) -> bool:
    return isinstance(cur, sqlite3.Cursor)


def is_storage_fault(exc: BaseException) -> bool:
    """True for what fails every statement alike: access, locking, space, I/O, a
    lost connection, a damaged file.

    Anything else raised while writing (an integer the column cannot hold, a
    constraint, an unencodable value) is that statement's own fault.
    """
    if isinstance(exc, sqlite3.OperationalError | sqlite3.InternalError | OSError | MemoryError):
        return True
    if type(exc) is sqlite3.DatabaseError:  # SQLITE_CORRUPT and SQLITE_NOTADB
        return True
    # PostgreSQL: connection, resources (disk full), locks, a read-only server,
    # a role without the right; InternalError covers the aborted transaction.
    return isinstance(
        exc,
        psycopg.OperationalError
        | psycopg.InterfaceError
        | psycopg.InternalError
        | psycopg.errors.InsufficientPrivilege,
    )
