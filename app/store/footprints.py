"""Each model's footprint as the log last recorded it (`gpu_memory_mib`), for the
memory router at start: a walk of the index on (type, at) backwards, bounded."""

from __future__ import annotations

from sqlalchemy import Engine, text

from app.core import events as ev

_FOOTPRINT_TYPES = ("swap_finished", "process_stopping", "process_stopped")
_RECENT = (
    "SELECT data FROM events WHERE type = :type AND data LIKE '%\"gpu_memory_mib\":%' "
    "ORDER BY at DESC, seq DESC LIMIT :limit"
)


def recent_footprints(engine: Engine, limit: int = 500) -> dict[str, int]:
    """Model -> its latest measured footprint (MiB) among the last `limit` events
    of each kind that record one; a model never measured is absent."""
    latest: dict[str, tuple[int, int]] = {}
    with engine.connect() as conn:
        for kind in _FOOTPRINT_TYPES:
            for (data,) in conn.execute(text(_RECENT), {"type": kind, "limit": limit}):
                event = ev.decode(data)
                mib = getattr(event, "gpu_memory_mib", None)
                model = ev.model_of(event)
                if mib is None or model is None:
                    continue
                if model not in latest or latest[model][0] < event.at:
                    latest[model] = (event.at, mib)
    return {model: mib for model, (_, mib) in sorted(latest.items())}
