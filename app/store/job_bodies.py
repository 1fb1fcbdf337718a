"""Durable jobs' request bodies: stored once, as bytes, in `job_bodies`.

A body is written in its own short transaction before its job's
`request_enqueued` is submitted; the event (and `requests.job`) keep only what
is needed to send it again: method, path, query, headers, and the body's length
and sha256, so a missing or damaged body is found before it is sent. A body is
deleted in the transaction that records its job's end (`read_model`: every
terminal event), so a job has its body for as long as recovery may run it
again. What is left behind (an enqueue that never reached the disk) is pruned
(`prune_bodies`).

Every function opens its own connection, so the web layer calls them in a thread.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import time
from pathlib import Path

from sqlalchemy import Connection, Engine, and_, exists, func, literal_column, select
from sqlalchemy import delete as sql_delete

from app.store.tables import OPEN_STATUSES, batch_lines, job_bodies, requests

_CHUNK = 1 << 20
"""Bytes written per blob write: memory stays flat whatever the body's size."""

WAL_COPIES = 2
"""How many times a body's size it needs on disk while it is written: SQLite
writes it to the write-ahead log first, then into the database file."""


class BodyMissing(Exception):
    """A job's body is not in `job_bodies`, or not the one it was submitted with."""


def store_body(engine: Engine, request_id: str, body: bytes) -> None:
    """Write `body` for `request_id`. On SQLite, through incremental blob I/O:
    a bound parameter would be copied whole twice more (the binding, the record)."""
    with engine.begin() as conn:
        if engine.dialect.name != "sqlite":
            conn.execute(
                job_bodies.insert().values(request_id=request_id, body=body, stored_at=time.time())
            )
            return
        inserted = conn.execute(
            job_bodies.insert().values(
                request_id=request_id, body=func.zeroblob(len(body)), stored_at=time.time()
            )
        )
        dbapi = conn.connection.dbapi_connection
        assert isinstance(dbapi, sqlite3.Connection)
        with dbapi.blobopen(job_bodies.name, "body", inserted.lastrowid) as blob:
            view = memoryview(body)
            for start in range(0, len(body), _CHUNK):
                blob.write(view[start : start + _CHUNK])


def load_body(
    engine: Engine, request_id: str, size: int | None = None, sha256: str | None = None
) -> bytes:
    """The stored body, checked against its recorded `size` and `sha256` when
    given; BodyMissing when it is absent or differs."""
    body: bytes | None
    with engine.connect() as conn:
        if engine.dialect.name != "sqlite":
            query = select(job_bodies.c.body).where(job_bodies.c.request_id == request_id)
            body = conn.execute(query).scalar()
        else:
            # Read straight into one bytes object (a SELECT assembles it, then copies it).
            query = select(literal_column("rowid")).where(job_bodies.c.request_id == request_id)
            rowid = conn.execute(query).scalar()
            body = None if rowid is None else _read_blob(conn, rowid)
    if body is None:
        raise BodyMissing(f"the body of job {request_id} is not in the database (job_bodies)")
    if size is not None and len(body) != size:
        raise BodyMissing(
            f"the stored body of job {request_id} has {len(body)} bytes, not {size} as submitted"
        )
    if sha256 is not None and hashlib.sha256(body).hexdigest() != sha256:
        raise BodyMissing(f"the stored body of job {request_id} is not the one submitted")
    return body


def _read_blob(conn: Connection, rowid: int) -> bytes:
    dbapi = conn.connection.dbapi_connection
    assert isinstance(dbapi, sqlite3.Connection)
    with dbapi.blobopen(job_bodies.name, "body", rowid, readonly=True) as blob:
        return blob.read()


def delete_body(engine: Engine, request_id: str) -> None:
    with engine.begin() as conn:
        conn.execute(sql_delete(job_bodies).where(job_bodies.c.request_id == request_id))


def prune_bodies(engine: Engine, orphans_before: float) -> int:
    """Delete the bodies nothing will read again; returns how many. These are
    bodies of jobs that ended (normally deleted with their terminal event
    already) and bodies without a request stored before `orphans_before` (unix
    seconds): their enqueue never reached the disk. A body stored since then
    may belong to an enqueue still being committed, so it stays."""
    ended = exists().where(
        and_(requests.c.id == job_bodies.c.request_id, requests.c.status.not_in(OPEN_STATUSES))
    )
    orphan = and_(
        ~exists().where(requests.c.id == job_bodies.c.request_id),
        # A batch's line not queued yet (a crash mid-way): queued on resume.
        ~exists().where(batch_lines.c.request_id == job_bodies.c.request_id),
        job_bodies.c.stored_at < orphans_before,
    )
    with engine.begin() as conn:
        return conn.execute(sql_delete(job_bodies).where(ended | orphan)).rowcount


def disk_free(engine: Engine) -> tuple[str, int] | None:
    """(directory, bytes free to an unprivileged writer) of the filesystem the
    database file is on; None for a database without a file (in memory, or on a
    PostgreSQL server, whose disk is the server's to watch)."""
    database = engine.url.database
    if (
        engine.dialect.name != "sqlite"
        or not database
        or database == ":memory:"
        or database.startswith("file:")
    ):
        return None
    directory = str(Path(database).resolve().parent)
    stat = os.statvfs(directory)
    return directory, stat.f_bavail * stat.f_frsize


def open_jobs_without_body(conn: Connection) -> list[str]:
    """Open durable jobs that cannot run: no stored body, and none in their event
    (logs of an earlier gpulane kept it there, base64). `db check` reports them."""
    query = (
        select(requests.c.id, requests.c.job)
        .where(requests.c.durable, requests.c.status.in_(OPEN_STATUSES))
        .where(~exists().where(job_bodies.c.request_id == requests.c.id))
        .order_by(requests.c.enqueue_seq)
    )
    return [rid for rid, job in conn.execute(query) if not (job or {}).get("body")]
