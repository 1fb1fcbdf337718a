"""The reads `explain` makes to find where its replay starts and what it starts from.

Each one is an indexed look-up or a bounded range, so explaining a request
costs the events since the oldest request open at its arrival, not the history
(docs/queries.md, "How explain works"). The replay logic is app/report/explain.py.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from typing import NamedTuple

import sqlalchemy
from sqlalchemy import RowMapping, select, text

from app.store.tables import requests

# Requests open at seq E = :seq (a superset is safe: it only starts the replay earlier).
# Open now, or finished after E: an event after E, looked up by ix_events_request_id
# among the requests finished since shortly before E (ix_requests_finished_at).
_OPEN_AT = """
SELECT min(enqueue_seq) FROM (
    SELECT enqueue_seq FROM requests
    WHERE status IN ('queued', 'running') AND enqueue_seq < :seq
    UNION ALL
    SELECT r.enqueue_seq FROM requests AS r
    WHERE r.finished_at >= :since AND r.enqueue_seq < :seq
      AND EXISTS (SELECT 1 FROM events AS e WHERE e.request_id = r.id AND e.seq > :seq)
) AS open_at
"""
# The `at` bound lets ix_events_type_at skip the older history.
_RESIDENCY_TYPES = (
    "type IN ('server_started', 'config_reloaded', 'swap_started', 'swap_finished', "
    "'swap_failed', 'process_stopping', 'process_stopped', 'process_started', "
    "'process_sleeping', 'process_slept', 'process_woken', 'sleep_skipped', "
    "'memory_wait_ended', 'gpu_memory_seen')"
)
_RESIDENCY = (
    "SELECT seq, data FROM events WHERE seq >= :from_seq AND seq < :to_seq AND at >= :since "
    f"AND {_RESIDENCY_TYPES} ORDER BY seq"
)
# Of each model, only the events since its last finished load: what came before
# it that still counts (its footprint, load time, failures in a row, sleep) is
# replaced or ended by it. Events of no model (a reload, others' GPU memory) all.
_RESIDENCY_SINCE_LOADS = f"""
WITH loaded AS (
    SELECT model, max(seq) AS seq FROM events
    WHERE type = 'swap_finished' AND seq >= :from_seq AND seq < :to_seq AND at >= :since
    GROUP BY model
)
SELECT e.seq, e.data FROM events AS e LEFT JOIN loaded ON loaded.model = e.model
WHERE e.seq >= :from_seq AND e.seq < :to_seq AND e.at >= :since AND e.{_RESIDENCY_TYPES}
  AND (loaded.seq IS NULL OR e.seq >= loaded.seq)
ORDER BY e.seq
"""


_LAST_DISPATCHES = (
    "SELECT max(seq), model, data FROM events WHERE type = 'request_dispatched' "
    "AND seq >= :from_seq AND seq < :to_seq "
    "GROUP BY model, json_extract(data, '$.choice') ORDER BY 1"
)
# PostgreSQL has no bare column beside max(): the last row of each group, by DISTINCT ON.
_LAST_DISPATCHES_POSTGRES = (
    "SELECT seq, model, data FROM (SELECT DISTINCT ON (model, CAST(data AS json) ->> 'choice') "
    "seq, model, data FROM events WHERE type = 'request_dispatched' "
    "AND seq >= :from_seq AND seq < :to_seq "
    "ORDER BY model, CAST(data AS json) ->> 'choice', seq DESC) AS last ORDER BY seq"
)


def last_dispatches(
    conn: sqlalchemy.Connection, from_seq: int, to_seq: int, models: Container[str]
) -> Iterator[LoggedEvent]:
    """The last `request_dispatched` to each of `models` (and per choice it was
    made for) with `from_seq <= seq < to_seq`, in seq order: what a peer's
    affinity and a choice's order depend on (`app.core.peers`)."""
    sql = _LAST_DISPATCHES if conn.dialect.name == "sqlite" else _LAST_DISPATCHES_POSTGRES
    rows = conn.execute(text(sql), {"from_seq": from_seq, "to_seq": to_seq})
    for seq, model, data in rows:
        if model in models:
            yield LoggedEvent(seq, data)


class Arrival(NamedTuple):
    """The event that put a request in the queue for its current attempt."""

    seq: int
    at: float
    """Unix seconds (the events.at column)."""


class LoggedEvent(NamedTuple):
    seq: int
    data: str
    """The event's JSON, undecoded."""


def request_row(conn: sqlalchemy.Connection, request_id: str) -> RowMapping | None:
    """The `requests` row of `request_id`, or None when the log has never seen it."""
    query = select(requests).where(requests.c.id == request_id)
    return conn.execute(query).mappings().first()


def last_arrival(conn: sqlalchemy.Connection, request_id: str) -> Arrival | None:
    """The last `request_enqueued` or `request_requeued` of `request_id`; None when it
    never queued (rejected at admission)."""
    row = conn.execute(
        text(
            "SELECT seq, at FROM events WHERE request_id = :id "
            "AND type IN ('request_enqueued', 'request_requeued') ORDER BY seq DESC LIMIT 1"
        ),
        {"id": request_id},
    ).first()
    return None if row is None else Arrival(row.seq, row.at)


def first_enqueue_open_at(
    conn: sqlalchemy.Connection, seq: int, finished_since_s: float
) -> int | None:
    """The smallest enqueue seq of the requests open at event `seq` (a superset: those
    finished before `finished_since_s` unix seconds are not looked at); None if none."""
    found = conn.execute(text(_OPEN_AT), {"since": finished_since_s, "seq": seq}).scalar()
    return None if found is None else int(found)


def last_event_before(
    conn: sqlalchemy.Connection, seq: int, kind: str = "server_started"
) -> LoggedEvent | None:
    """The last event of type `kind` with a seq below `seq`."""
    row = conn.execute(
        text(
            "SELECT seq, data FROM events WHERE type = :kind AND seq < :seq "
            "ORDER BY seq DESC LIMIT 1"
        ),
        {"kind": kind, "seq": seq},
    ).first()
    return None if row is None else LoggedEvent(row.seq, row.data)


def last_swap_seq_before(conn: sqlalchemy.Connection, seq: int) -> int | None:
    """The seq of the last swap started below `seq` (the `swaps` read model)."""
    found = conn.execute(text("SELECT max(seq) FROM swaps WHERE seq < :seq"), {"seq": seq}).scalar()
    return None if found is None else int(found)


def event_at(conn: sqlalchemy.Connection, seq: int) -> float | None:
    """When event `seq` was recorded (unix seconds), or None when there is no such event."""
    found = conn.execute(text("SELECT at FROM events WHERE seq = :seq"), {"seq": seq}).scalar()
    return None if found is None else float(found)


def residency_events(
    conn: sqlalchemy.Connection,
    from_seq: int,
    to_seq: int,
    since_s: float,
    *,
    since_loads: bool = False,
) -> Iterator[LoggedEvent]:
    """The events that change which model is resident or loading (server starts, swaps,
    process stops and sleeps), with `from_seq <= seq < to_seq` and recorded at or after
    `since_s`, in seq order. `since_loads`: of each model, only those since its last
    `swap_finished` in that range (the state they fold to is the same: a model's
    eviction, stop or sleep is an event of its own after its load)."""
    sql = _RESIDENCY_SINCE_LOADS if since_loads else _RESIDENCY
    rows = conn.execute(text(sql), {"from_seq": from_seq, "to_seq": to_seq, "since": since_s})
    for seq, data in rows:
        yield LoggedEvent(seq, data)
