"""What the web layer reads of the run loop: read-only views of its state,
its processes and its log (a part of `Scheduler`, app/runtime/scheduler.py).
Nothing here changes anything."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

from prometheus_client import CollectorRegistry

from app.core.run_estimate import Durations, RunEstimates
from app.core.state import SchedulerState
from app.runtime.api import LiveState, ModelStatus, OpenStatus
from app.runtime.gpu import MemoryStatus
from app.runtime.metrics import Metrics
from app.runtime.places import Places
from app.runtime.ports import EventSink
from app.runtime.processes import Processes
from app.runtime.swaps import Swaps


class SchedulerViews:
    """Read-only views for the web layer (mixed into `Scheduler`)."""

    state: SchedulerState
    store: EventSink
    clock: Callable[[], int]
    processes: Processes
    run_estimates: RunEstimates
    running_since: dict[str, int]
    metrics: Metrics
    places: Places
    swaps: Swaps

    @property
    def resident(self) -> str | None:
        """The model that became ready last (`residents` has them all)."""
        return self.state.resident

    @property
    def residents(self) -> list[str]:
        """The models loaded and ready, in the order they became so."""
        return list(self.state.residents)

    def target_of(self, request_id: str, model: str) -> str:
        """The model a dispatched request runs on: `model`, or for a model several
        peers serve, the peer's entry the scheduler chose (`app.core.peers`)."""
        return self.state.running.get(request_id) or model

    def is_resident(self, model: str) -> bool:
        return model in self.state.residents

    def durations(self) -> Durations:
        """Each model's run and load times as learnt so far (`run_estimates`): what
        every estimate of this server counts (the live queue, a batch's ETA,
        Retry-After; app/core/start_estimate.py)."""
        return self.run_estimates.durations(self.state.asleep)

    def live(self) -> LiveState:
        return LiveState(state=self.state, running_since=self.running_since, now_ns=self.clock())

    def open_status(self, request_id: str) -> OpenStatus | None:
        request = self.state.requests.get(request_id)
        if request is None:
            return None
        status: Literal["queued", "running"] = "running" if request.running else "queued"
        queued = self.state.queue.get(request_id)
        if queued is None:
            return OpenStatus(status=status, attempt=request.attempt)
        score = self.state.score(queued, self.clock())
        return OpenStatus(status=status, attempt=request.attempt, score=score)

    async def ahead(self, request_id: str) -> int | None:
        """How many waiting requests go before this one in the live queue's order
        (0: it goes next), None when it does not wait: computed when asked, kept
        while the state does not change (app/runtime/places.py)."""
        return await self.places.ahead(request_id)

    def model_status(self, model: str) -> ModelStatus:
        proc = self.processes.get(model)
        if model in self.state.loads:
            state: Literal["starting", "ready", "stopping", "sleeping", "stopped"] = "starting"
        elif proc is not None and proc.running:
            state = "ready"
        elif model in self.processes.stopping():
            state = "stopping"
        elif model in self.swaps.sleepers:
            state, proc = "sleeping", self.swaps.sleepers.asleep[model].proc
        else:
            state = "stopped"
        pid = None if proc is None else proc.pid
        return ModelStatus(state=state, pid=pid, in_flight=self.state.running_on(model))

    def log_refusal(self) -> tuple[str, int] | None:
        """Why the event log refuses writes now and the seconds until it is tried
        again (at least 1); None while it accepts them."""
        failure = self.store.failure
        if failure is None:
            return None
        return failure, max(1, math.ceil(self.store.retry_in))

    def metrics_registry(self) -> CollectorRegistry:
        return self.metrics.registry

    def memory_status(self) -> MemoryStatus:
        """GPU memory for the console: the GPU, the budget, each model's footprint."""
        return self.swaps.memory_status()

    def loaded_models(self) -> list[str]:
        """Models with a server process (running, starting or asleep)."""
        return self.processes.models() + self.swaps.sleepers.models()

    def stopping_models(self) -> list[str]:
        """Models whose process is being stopped now, sorted."""
        return sorted(self.processes.stopping())
