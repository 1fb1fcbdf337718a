"""Read-only queries over the read models, for the HTTP API and the CLI."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

from sqlalchemy import Engine, select

from app.store.cursor import driver_cursor
from app.store.tables import OPEN_STATUSES, requests


def activity(
    engine: Engine, limit: int, offset: int, caller: str | None = None
) -> list[dict[str, Any]]:
    """Requests newest first (only `caller`'s when given), with the scheduler's
    view of each (`serial_*` fields, named as llama-swap's activity page expects)."""
    query = select(requests)
    if caller is not None:
        query = query.where(requests.c.caller == caller)
    query = query.order_by(requests.c.enqueue_seq.desc()).limit(limit).offset(offset)
    with engine.connect() as conn:
        rows = conn.execute(query).mappings().all()
    out = []
    for row in rows:
        item = dict(row)
        item.pop("job", None)
        item["serial_priority"] = row["priority"]
        item["serial_band"] = row["band"]
        item["serial_score"] = row["score"]
        item["serial_queue_wait_ms"] = row["queue_wait_ms"]
        out.append(item)
    return out


class OpenEnqueue(NamedTuple):
    """What recovery needs of an open request's row."""

    id: str
    status: str
    durable: int
    attempt: int


# Sort the narrow request rows first, then fetch each enqueue event in that order
# (LIMIT -1 keeps SQLite from flattening the subquery, which would sort the event
# data too). Raw driver cursor: no per-row SQLAlchemy processing, no decoding of
# the requests.job JSON (the event carries the job).
_OPEN_ENQUEUES = (
    "SELECT r.id, r.status, r.durable, r.attempt, e.data FROM ("
    "SELECT id, status, durable, attempt, enqueue_seq FROM requests "
    f"WHERE status IN ({', '.join('?' * len(OPEN_STATUSES))}) ORDER BY enqueue_seq LIMIT -1"
    ") AS r CROSS JOIN events AS e ON e.seq = r.enqueue_seq"
)
# PostgreSQL keeps no order through a join: it is asked for (and merges on the indexes).
_OPEN_ENQUEUES_POSTGRES = (
    "SELECT r.id, r.status, r.durable, r.attempt, e.data FROM requests AS r "
    "JOIN events AS e ON e.seq = r.enqueue_seq "
    f"WHERE r.status IN ({', '.join('?' * len(OPEN_STATUSES))}) ORDER BY r.enqueue_seq"
)


def open_enqueues(engine: Engine, chunk: int = 1000) -> Iterator[tuple[OpenEnqueue, str]]:
    """(requests row, its request_enqueued event JSON) for every queued or running
    request, in arrival order: one indexed join, proportional to what is open.
    Streams (in one read transaction), so the event JSON is never all in memory."""
    with engine.connect() as conn:
        cur = driver_cursor(conn, stream="open_enqueues")
        sqlite = conn.dialect.name == "sqlite"
        try:
            cur.execute(_OPEN_ENQUEUES if sqlite else _OPEN_ENQUEUES_POSTGRES, OPEN_STATUSES)
            while rows := cur.fetchmany(chunk):
                for rid, status, durable, attempt, data in rows:
                    yield OpenEnqueue(rid, status, durable, attempt), data
        finally:
            cur.close()
