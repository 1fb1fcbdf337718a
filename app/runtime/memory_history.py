"""What the memory router knows from the log when a server starts: each model's
footprint last measured and its load time, recorded in the `server_started`
(its router's `measured_mib` and `load_ns`), so every decision of this process
replays from the log alone."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from app.core import events as ev
from app.core.residency import MemoryRouter
from app.core.run_estimate import RunEstimates


def with_history(
    started: ev.ServerStarted,
    footprints: Mapping[str, int],
    loads: Iterable[tuple[str, float]],
) -> ev.ServerStarted:
    """`started` with its memory router knowing `footprints` (MiB) and each
    model's median load time of `loads` ((model, ms), oldest first); any other
    router, or none, as it was."""
    router = started.router
    if not isinstance(router, MemoryRouter):
        return started
    estimates = RunEstimates()
    for model, load_ms in loads:
        estimates.observe_load(model, int(load_ms * 1e6))
    router = msgspec.structs.replace(
        router,
        measured_mib=dict(sorted(footprints.items())),
        load_ns=dict(sorted(estimates.durations().load_ns.items())),
    )
    return msgspec.structs.replace(started, router=router)
