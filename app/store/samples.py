"""Recent measured run and load times, newest first, for estimates.

Each query walks an index backwards and stops after `limit` rows, so its cost
does not grow with the history; `lane_samples` reads a window of the last
week once, at start.
"""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import Engine, text

_RUNS = (
    "SELECT model, endpoint, run_ms FROM requests WHERE finished_at IS NOT NULL "
    "AND status = 'completed' AND run_ms IS NOT NULL AND model IS NOT NULL "
    "ORDER BY finished_at DESC, id DESC LIMIT :limit"
)
_SWAPS = (
    "SELECT to_model, duration_ms FROM swaps WHERE error IS NULL AND duration_ms IS NOT NULL "
    "ORDER BY seq DESC LIMIT :limit"
)


def recent_samples(
    engine: Engine, runs: int, swaps: int
) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """(model, run ms) of the last `runs` completed requests and (model, load ms)
    of the last `swaps` successful swaps."""
    with engine.connect() as conn:
        swap_rows = conn.execute(text(_SWAPS), {"limit": swaps}).all()
    run_rows = [(m, ms) for m, _endpoint, ms in recent_runs(engine, runs)]
    return run_rows, [(m, ms) for m, ms in swap_rows]


def recent_runs(engine: Engine, limit: int) -> list[tuple[str, str, float]]:
    """(model, endpoint, run ms) of the last `limit` completed requests, oldest first
    (the order they completed in, as a run-time estimate learns them)."""
    with engine.connect() as conn:
        rows = conn.execute(text(_RUNS), {"limit": limit}).all()
    return [(m, e, ms) for m, e, ms in reversed(rows)]


_LANE_RUNS = (
    "SELECT enqueued_at, model, priority, run_ms FROM requests "
    "WHERE finished_at >= ? AND finished_at < ? AND run_ms IS NOT NULL AND model IS NOT NULL"
)
_LANE_LOADS = (
    "SELECT s.started_at, s.to_model, r.priority, s.duration_ms FROM swaps s "
    "LEFT JOIN requests r ON r.id = s.request_id "
    "WHERE s.started_at >= ? AND s.started_at < ? AND s.error IS NULL "
    "AND s.duration_ms IS NOT NULL"
)
_FIRST_EVENT = "SELECT at FROM events ORDER BY seq LIMIT 1"


class LaneSamples(NamedTuple):
    first_at: float | None
    """When the log begins (unix seconds); None for an empty log."""
    runs: list[tuple[float, str, int, float]]
    """(enqueued at, model, priority, run ms) of the runs that ended in the window."""
    loads: list[tuple[float, str, int | None, float]]
    """(started at, model, the priority of the request it was for, load ms)."""


def lane_samples(engine: Engine, since: float, until: float) -> LaneSamples:
    """What the runs and loads of [since, until) took (unix seconds), for the
    forecast of overtaking work (app/core/lane_history.py). Read once at start:
    the runs through the index on `finished_at`, the loads (a few per hour of
    work) by a scan of `swaps`."""
    with engine.connect() as conn:
        first = conn.exec_driver_sql(_FIRST_EVENT).scalar()
        runs = conn.exec_driver_sql(_LANE_RUNS, (since, until)).all()
        loads = conn.exec_driver_sql(_LANE_LOADS, (since, until)).all()
    return LaneSamples(
        None if first is None else float(first),
        [(a, m, p, ms) for a, m, p, ms in runs],
        [(a, m, p, ms) for a, m, p, ms in loads],
    )
