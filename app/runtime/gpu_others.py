"""Memory other processes hold on the GPU, for the memory router's budget.

Under the memory router with GPU telemetry, every `EVERY_S` seconds the GPU's
used memory less what gpulane's own model servers hold (their process trees'
pids, and stopped ones still releasing) is what other processes hold. When it
moved by `STEP_MIB` or more since the last record, it is recorded
(`gpu_memory_seen`, so the replay decides with it too) and the run loop asked to
dispatch again. Where the GPU lists none of gpulane's pids although models are
loaded (a container), the footprints of the models in use stand for them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Final, Protocol

from app.core import events as ev
from app.core.residency import MemoryRouter
from app.core.state import SchedulerState
from app.runtime.gpu import GpuMemory, tree_pids
from app.runtime.ports import Timers
from app.runtime.processes import Processes

EVERY_S: Final = 2.0
STEP_MIB: Final = 1024


class _Loop(Protocol):
    state: SchedulerState
    clock: Callable[[], int]

    def emit(self, events: Iterable[ev.AnyEvent]) -> asyncio.Future[list[int]]: ...
    def pump(self) -> None: ...


class OthersWatch:
    def __init__(
        self,
        loop: _Loop,
        timers: Timers,
        gpu: Callable[[], GpuMemory],
        processes: Processes,
        stopped_pids: Callable[[], Iterable[int]],
    ) -> None:
        self._loop = loop
        self._timers = timers
        self._gpu = gpu
        self._processes = processes
        self._stopped_pids = stopped_pids
        self._armed = False

    def start(self) -> None:
        """Look now and every `EVERY_S` seconds while there is telemetry."""
        if not self._armed and self._gpu().telemetry is not None:
            self._armed = True
            self._tick()

    def _tick(self) -> None:
        self.look()
        self._timers.call_later(EVERY_S, self._tick)

    def look(self) -> None:
        """Record what other processes hold when it moved by `STEP_MIB` or more."""
        state = self._loop.state
        if not isinstance(state.router, MemoryRouter):
            return
        snap = self._gpu().snapshot()
        if snap is None:
            return
        ours: set[int] = set(self._stopped_pids())
        for model in self._processes.models():
            proc = self._processes.get(model)
            if proc is not None and proc.pid is not None:
                ours |= tree_pids(proc.pid)
        held = snap.held_by(ours)
        if held is None:
            in_use = [state.router.footprint(m, state.measured_mib) for m in state.in_use]
            held = sum(mib for mib in in_use if mib is not None)
        others = max(0, snap.used_mib - held)
        if abs(others - state.others_mib) < STEP_MIB:
            return
        self._loop.emit(
            [
                ev.GpuMemorySeen(
                    at=self._loop.clock(),
                    others_mib=others,
                    used_mib=snap.used_mib,
                    total_mib=snap.total_mib,
                )
            ]
        )
        self._loop.pump()
