"""Read-only queries behind the web console's timeline, history and story pages.

Each one is bounded by a window or a LIMIT and walks an index (`requests`
by finished_at or band/enqueued_at, `swaps` by seq, `events` by request_id),
so a page costs what it shows, not the whole history.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from sqlalchemy import Engine, and_, case, func, or_, select

from app.store.tables import OPEN_STATUSES, events, requests, swaps

_BAR_COLUMNS = (
    requests.c.id,
    requests.c.model,
    requests.c.band,
    requests.c.priority,
    requests.c.caller,
    requests.c.status,
    requests.c.enqueued_at,
    requests.c.dispatched_at,
    requests.c.started_at,
    requests.c.finished_at,
    requests.c.queue_wait_ms,
)


def log_span(engine: Engine) -> tuple[float, float] | None:
    """(first, last) event time in unix seconds; None for an empty log."""
    with engine.connect() as conn:
        first, last = conn.execute(select(func.min(events.c.at), func.max(events.c.at))).one()
    return None if first is None else (float(first), float(last))


def timeline_requests(
    engine: Engine, since: float, until: float, caller: str | None, limit: int
) -> list[dict[str, Any]]:
    """Requests that held the GPU at some point in [since, until], oldest first."""
    # Open ones (finished_at NULL) reach `until`; they are few, so the OR stays cheap.
    query = (
        select(*_BAR_COLUMNS)
        .where(
            requests.c.dispatched_at.is_not(None),
            requests.c.dispatched_at <= until,
            or_(requests.c.finished_at >= since, requests.c.finished_at.is_(None)),
        )
        .order_by(requests.c.dispatched_at, requests.c.id)
        .limit(limit)
    )
    if caller is not None:
        query = query.where(requests.c.caller == caller)
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(query).mappings()]


def timeline_swaps(engine: Engine, since: float, until: float, limit: int) -> list[dict[str, Any]]:
    """Swaps (model loads) overlapping [since, until], oldest first, each with the
    `caller` of the request that caused it (None for a preload)."""
    query = (
        select(swaps, requests.c.caller)
        .select_from(swaps.outerjoin(requests, requests.c.id == swaps.c.request_id))
        .where(
            swaps.c.started_at <= until,
            or_(swaps.c.finished_at >= since, swaps.c.finished_at.is_(None)),
        )
        .order_by(swaps.c.seq)
        .limit(limit)
    )
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(query).mappings()]


_FOOTPRINT_TYPES = ("swap_finished", "process_stopping", "process_stopped")


def timeline_footprints(
    engine: Engine, since: float, until: float, limit: int
) -> list[dict[str, Any]]:
    """Footprints the log recorded in [since, until] (`gpu_memory_mib` of a load's
    end or a stop), oldest first: the timeline labels each residency with them.
    Walks the index on (type, at); events without a measure are skipped."""
    query = (
        select(events.c.at, events.c.type, events.c.model, events.c.data)
        .where(
            events.c.type.in_(_FOOTPRINT_TYPES),
            events.c.at >= since,
            events.c.at <= until,
            events.c.data.like('%"gpu_memory_mib":%'),
        )
        .order_by(events.c.seq)
        .limit(limit)
    )
    out: list[dict[str, Any]] = []
    with engine.connect() as conn:
        for row in conn.execute(query).mappings():
            mib = json.loads(row["data"]).get("gpu_memory_mib")
            if isinstance(mib, int) and row["model"]:
                out.append({"at": row["at"], "model": row["model"], "mib": mib})
    return out


def _finished_filter(
    since: float,
    until: float,
    model: str | None,
    band: str | None,
    caller: str | None,
    status: str | None,
) -> Any:
    terms = [
        requests.c.finished_at.is_not(None),
        requests.c.finished_at >= since,
        requests.c.finished_at <= until,
        requests.c.status.not_in(OPEN_STATUSES),
    ]
    for column, value in (
        (requests.c.model, model),
        (requests.c.band, band),
        (requests.c.caller, caller),
    ):
        if value is not None:
            terms.append(column == value)
    if status == "rejected":
        terms.append(requests.c.model.is_(None))
    elif status is not None:
        terms += [requests.c.status == status, requests.c.model.is_not(None)]
    return and_(*terms)


_SHOWN_STATUS = case((requests.c.model.is_(None), "rejected"), else_=requests.c.status).label(
    "status"
)
"""A row's status as the history shows it: a refusal's row (no model: it was
refused before it queued, read_model.py's `_rejected`) is stored `failed`."""


def finished_requests(
    engine: Engine,
    since: float,
    until: float,
    *,
    model: str | None = None,
    band: str | None = None,
    caller: str | None = None,
    status: str | None = None,
    limit: int = 50,
    offset: int = 0,
) -> tuple[list[dict[str, Any]], int]:
    """A page of finished requests, newest first, and how many match in all."""
    where = _finished_filter(since, until, model, band, caller, status)
    page = (
        select(
            *(_SHOWN_STATUS if c is requests.c.status else c for c in _BAR_COLUMNS),
            requests.c.run_ms,
            requests.c.swap_ms,
            requests.c.http_status,
        )
        .where(where)
        .order_by(requests.c.finished_at.desc(), requests.c.id.desc())
        .limit(limit)
        .offset(offset)
    )
    with engine.connect() as conn:
        rows = [dict(r) for r in conn.execute(page).mappings()]
        total = int(conn.execute(select(func.count()).where(where)).scalar_one())
    return rows, total


def wait_samples(
    engine: Engine,
    since: float,
    until: float,
    *,
    model: str | None = None,
    band: str | None = None,
    caller: str | None = None,
    status: str | None = None,
    limit: int = 200_000,
) -> list[tuple[str, float]]:
    """(band, wait ms) of finished requests that queued (app/core/wait.py: one never
    dispatched waited until its end), newest first."""
    where = and_(
        _finished_filter(since, until, model, band, caller, status),
        requests.c.queue_wait_ms.is_not(None),
    )
    query = (
        select(requests.c.band, requests.c.queue_wait_ms)
        .where(where)
        .order_by(requests.c.finished_at.desc(), requests.c.id.desc())
        .limit(limit)
    )
    with engine.connect() as conn:
        return [(b, float(ms)) for b, ms in conn.execute(query)]


def request_caller(engine: Engine, request_id: str) -> tuple[bool, str | None]:
    """(known, caller) of a request, for deciding who may read its events."""
    with engine.connect() as conn:
        row = conn.execute(select(requests.c.caller).where(requests.c.id == request_id)).first()
    return (False, None) if row is None else (True, row[0])


def request_callers(engine: Engine, request_ids: Collection[str]) -> dict[str, str | None]:
    """The caller of each of `request_ids` the log knows (by primary key)."""
    if not request_ids:
        return {}
    query = select(requests.c.id, requests.c.caller).where(requests.c.id.in_(list(request_ids)))
    with engine.connect() as conn:
        return {row[0]: row[1] for row in conn.execute(query)}


def request_events(engine: Engine, request_id: str, limit: int = 1000) -> list[dict[str, Any]]:
    """The events naming a request, in log order (type and JSON data undecoded)."""
    query = (
        select(events.c.seq, events.c.at, events.c.type, events.c.data)
        .where(events.c.request_id == request_id)
        .order_by(events.c.seq)
        .limit(limit)
    )
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(query).mappings()]


def models_in_log(engine: Engine) -> list[str]:
    """Models the log has loaded (for the read-only models page)."""
    with engine.connect() as conn:
        return sorted(r[0] for r in conn.execute(select(swaps.c.to_model).distinct()))
