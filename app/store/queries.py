"""Read-only queries over the read models, for the HTTP API and the CLI."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, select

from app.store.tables import OPEN_STATUSES, events, requests


def activity(engine: Engine, limit: int, offset: int) -> list[dict[str, Any]]:
    """Requests newest first, with the scheduler's view of each (`serial_*` fields,
    named as llama-swap's activity page expects)."""
    query = select(requests).order_by(requests.c.enqueue_seq.desc()).limit(limit).offset(offset)
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


def open_enqueues(engine: Engine) -> list[tuple[Any, str]]:
    """(requests row, its request_enqueued event JSON) for every queued or running
    request, in arrival order: one indexed join, proportional to what is open."""
    query = (
        select(requests, events.c.data.label("enqueued_event"))
        .join(events, events.c.seq == requests.c.enqueue_seq)
        .where(requests.c.status.in_(OPEN_STATUSES))
        .order_by(requests.c.enqueue_seq)
    )
    with engine.connect() as conn:
        return [(row, row.enqueued_event) for row in conn.execute(query)]
