"""Recent measured run and load times, newest first, for estimates.

Each query walks an index backwards and stops after `limit` rows, so its cost
does not grow with the history.
"""

from __future__ import annotations

from sqlalchemy import Engine, text

_RUNS = (
    "SELECT model, endpoint, run_ms FROM requests WHERE finished_at IS NOT NULL "
    "AND status = 'completed' AND run_ms IS NOT NULL AND model IS NOT NULL "
    "ORDER BY finished_at DESC LIMIT :limit"
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
