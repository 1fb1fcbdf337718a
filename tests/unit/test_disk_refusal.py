"""Which database errors a starting server waits out (`refused_by_disk`): the
disk refusing a write (full, an I/O error), never a damaged, locked or
read-only database, which stops the start with its message."""

from __future__ import annotations

import sqlite3

import psycopg
import pytest
import sqlalchemy

from app.store.engine import DatabaseError, refused_by_disk


def sqlite_error(text: str, name: str) -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError(text)
    exc.sqlite_errorname = name  # type: ignore[attr-defined]
    return exc


def as_raised(cause: BaseException) -> DatabaseError:
    """As open_database and acquire raise it: a DatabaseError from SQLAlchemy's."""
    wrapped = sqlalchemy.exc.OperationalError("UPDATE server_lease", {}, cause)
    try:
        try:
            raise wrapped
        except sqlalchemy.exc.OperationalError as exc:
            raise DatabaseError("gpulane.db: cannot take the lease") from exc
    except DatabaseError as exc:
        return exc


@pytest.mark.parametrize(
    ("cause", "waited"),
    [
        (sqlite_error("database or disk is full", "SQLITE_FULL"), True),
        (sqlite_error("disk I/O error", "SQLITE_IOERR_SHMSIZE"), True),
        (psycopg.errors.DiskFull("could not extend file"), True),
        (sqlite_error("attempt to write a readonly database", "SQLITE_READONLY"), False),
        (sqlite_error("database is locked", "SQLITE_BUSY"), False),
        (sqlite3.DatabaseError("database disk image is malformed"), False),
    ],
)
def test_only_the_disk_refusing_writes_is_waited_for(cause: BaseException, waited: bool) -> None:
    assert refused_by_disk(as_raised(cause)) is waited
    assert not refused_by_disk(DatabaseError("gpulane.db: not an SQLite database"))
