"""The lane's loads and stops: what the run loop records about model servers.

`Scheduler` owns requests; this owns what happens to the processes serving
them. It asks the core what a load evicts, stops and waits for
(`app.core.loads`), records each step (`swap_started`, `process_stopping`,
`process_started`, `process_stopped`) and has `Processes` carry it out; when a
load ends it tells the run loop (`RunLoop.load_ended`), which records the
swap's end and releases or fails the requests that waited. It also holds the
timers about models: a model's TTL, and the end of a model's load back-off.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from app.config import Config, ModelConfig
from app.core import events as ev
from app.core.loads import idle_evictions, plan_load, preload_evictions
from app.core.residency import MemoryRouter, plan_preload
from app.core.state import SchedulerState
from app.runtime.gpu import GpuMemory, MemoryStatus, memory_status, tree_pids
from app.runtime.gpu_others import OthersWatch
from app.runtime.log_buffer import LogBuffer
from app.runtime.memory_release import MemoryRelease
from app.runtime.out_of_memory import gpu_in_use, out_of_memory_error
from app.runtime.ports import Timers
from app.runtime.processes import Processes, Upstream, UpstreamFactory
from app.runtime.sleepers import Sleepers
from app.runtime.upstream import UpstreamProcess

log = logging.getLogger("gpulane.scheduler")


class RunLoop(Protocol):
    """What `Swaps` needs of the scheduler."""

    state: SchedulerState
    clock: Callable[[], int]

    def emit(self, events: Iterable[ev.AnyEvent]) -> asyncio.Future[list[int]]: ...
    def pump(self) -> None: ...
    def load_ended(
        self,
        model: str,
        error: str | None,
        seconds: float,
        gpu_memory_mib: int | None = None,
        out_of_memory: str | None = None,
    ) -> None: ...


class Swaps:
    def __init__(
        self,
        loop: RunLoop,
        config: Config,
        timers: Timers,
        upstreams: UpstreamFactory | None = None,
        *,
        logs: LogBuffer,
        owner: str = "",
    ) -> None:
        self._loop = loop
        self.config = config
        self._timers = timers
        self._logs = logs
        self._owner = owner
        self.processes = Processes(self, upstreams or self._upstream_process, loop.clock)
        self.sleepers = Sleepers(self, self.processes, loop.clock)
        """Servers put to sleep instead of stopped (a model's `sleep` config)."""
        self._last_used: dict[str, int] = {}
        self._retiring: set[str] = set()
        """Models a reload removed or changed, busy then: stopped once idle."""
        self._removed: dict[str, ModelConfig] = {}
        """Models a reload removed while in use, as configured before it."""
        self.gpu = GpuMemory(None)
        """GPU telemetry and the footprints measured with it (serve sets it)."""
        self.memory = MemoryRelease(self, loop, timers)
        """Loads wait for stopped models' GPU memory (app/runtime/memory_release.py)."""
        self.processes.before_start = self.memory.wait
        self.others = OthersWatch(
            loop, timers, lambda: self.gpu, self.processes, self.memory.stopped_pids
        )
        """What other processes hold on the GPU (app/runtime/gpu_others.py): serve starts it."""

    def spec(self, model: str) -> ModelConfig:
        """`model`'s config: the current one, or for a model a reload removed
        while it was in use, the one it runs under until it stops."""
        spec = self.config.models.get(model)
        return spec if spec is not None else self._removed[model]

    def begin(
        self, model: str, request_id: str | None, evicted: Iterable[str] | None = None
    ) -> None:
        """Load `model` (for `request_id`, None: a preload), evicting `evicted`: the
        decision's, else what the core says a load no dispatch planned evicts
        (`loads.idle_evictions`: a reload after a crash leaves busy ones alone)."""
        state = self._loop.state
        names = sorted(idle_evictions(state, model) if evicted is None else evicted)
        # The dispatch that asked for this swap is applied already: what it evicts
        # says where the lane comes from (several: `evicted` names them).
        from_model = names[0] if len(names) == 1 else None
        self._loop.emit(
            [
                ev.SwapStarted(
                    at=self._loop.clock(),
                    from_model=from_model,
                    to_model=model,
                    request_id=request_id,
                    evicted=names,
                )
            ]
        )
        log.info(
            "loading %s%s%s",
            model,
            f" for request {request_id}" if request_id else " (preload)",
            f", evicting {', '.join(names)}" if names else "",
        )
        plan = plan_load(
            state.router, model, names, self.processes.models(), self.processes.stopping()
        )
        for other in plan.stop:
            if not self.sleepers.evict(other, evicted_for=model, evicted_by=request_id):
                self.stop(other, "evicted", evicted_for=model, evicted_by=request_id)
        self.processes.load(self.spec(model), plan.wait_for)

    def memory_status(self) -> MemoryStatus:
        """GPU memory as the console shows it (`gpu.memory_status`)."""
        state = self._loop.state
        router = state.router
        measured = dict(state.measured_mib)
        if isinstance(router, MemoryRouter):
            measured = {**router.measured_mib, **measured}
        budget = router.budget_mib if isinstance(router, MemoryRouter) else None
        resident = [*state.residents, *state.loads]  # in the order they became so
        return memory_status(self.config, self.gpu, measured, budget, resident)

    def preload_all(self, models: Iterable[str]) -> list[str]:
        """`hooks.on_startup.preload`: load what loading the listed models in turn
        leaves resident (`residency.plan_preload`: of several that cannot be
        resident together the last stays; a warning names each other one).
        Loads in different lanes run in parallel. Returns the models loading."""
        router = self.config.router
        plan = plan_preload(router, models)
        for skipped in plan.skipped:
            log.warning("preload: %s", skipped.why(router))
        return [model for model in plan.load if self.preload(model)]

    def preload(self, model: str) -> bool:
        """Load `model` for no request, if that evicts only idle models
        (`loads.preload_evictions`); True when its load began."""
        evict = preload_evictions(self._loop.state, model)
        if evict is None:
            return False
        self.begin(model, request_id=None, evicted=evict)
        return True

    def _upstream_process(
        self, spec: ModelConfig, on_spawn: Callable[[Upstream], None]
    ) -> Upstream:
        return UpstreamProcess(
            spec,
            health_check_timeout=self.config.health_check_timeout,
            logs=self._logs,
            on_spawn=on_spawn,
            owner=self._owner,
        )

    def record(self, events: Iterable[ev.AnyEvent]) -> None:
        """Record facts about a model's server (the sleepers'), then pump: a
        stop may let a load go on."""
        self._loop.emit(events)
        self._loop.pump()

    # -- facts from the processes ---------------------------------------------

    def process_spawned(self, model: str, proc: Upstream) -> None:
        assert proc.pid is not None
        self.gpu.before_load(model)  # its growth from here is its footprint
        self._loop.emit(
            [
                ev.ProcessStarted(
                    at=self._loop.clock(),
                    model=model,
                    pid=proc.pid,
                    cmdline=list(proc.cmdline),
                    port=self.spec(model).port,
                )
            ]
        )

    def load_ended(
        self, model: str, error: str | None, seconds: float, failed: Upstream | None
    ) -> None:
        if failed is not None and failed.pid is not None:
            # start() already stopped it; close the record ProcessStarted opened.
            self._loop.emit(
                [
                    ev.ProcessStopped(
                        at=self._loop.clock(),
                        model=model,
                        pid=failed.pid,
                        reason="failed_start",
                        exit_code=failed.exit_code,
                        out_of_memory=failed.out_of_memory,
                    )
                ]
            )
        footprint = self.measure(model) if error is None else None
        oom = None if failed is None or error is None else failed.out_of_memory
        if error is not None and oom is not None:
            error = out_of_memory_error(oom, self.gpu_in_use(), error)
        self._loop.load_ended(model, error, seconds, footprint, oom)

    def gpu_in_use(self) -> str | None:
        """Who holds the GPU's memory now, a phrase (`out_of_memory.gpu_in_use`):
        one snapshot, and the pids of each model with a process or still
        releasing memory. None without telemetry."""
        snap = self.gpu.snapshot()
        if snap is None:
            return None
        pids: dict[str, set[int]] = {}
        for holder in self.memory.holders():
            pids.setdefault(holder.model, set()).add(holder.pid)
        for model in self.processes.models():
            proc = self.processes.get(model)
            if proc is not None and proc.pid is not None:
                pids.setdefault(model, set()).update(tree_pids(proc.pid))
        return gpu_in_use(snap, pids)

    def measure(self, model: str) -> int | None:
        """`model`'s footprint now (`GpuMemory.measure`), checked against its
        declared `gpuMemory`: a warning when they differ by more than a tenth."""
        proc = self.processes.get(model)
        footprint = self.gpu.measure(model, tree_pids(None if proc is None else proc.pid))
        declared = self.config.models.get(model)
        declared_mib = None if declared is None else declared.gpu_memory_mib
        off = (
            footprint is not None
            and declared_mib
            and abs(footprint - declared_mib) > declared_mib / 10
        )
        if off:
            log.warning(
                "%s holds %d MiB of GPU memory; it declares gpuMemory %d MiB (more than a tenth "
                "off): the measurement is used from now on",
                model,
                footprint,
                declared_mib,
            )
        return footprint

    def process_crashed(self, model: str, proc: Upstream, exit_code: int) -> None:
        assert proc.pid is not None
        self.sleepers.forget(model, proc)
        self.memory.stopping(model, proc)
        self._loop.emit(
            [
                ev.ProcessStopped(
                    at=self._loop.clock(),
                    model=model,
                    pid=proc.pid,
                    reason="crashed",
                    exit_code=exit_code,
                    gpu_memory_mib=self.gpu.stopped(model),
                    out_of_memory=proc.out_of_memory,
                )
            ]
        )
        self._loop.pump()

    def arm_backoff(self, model: str) -> None:
        """Pump when `model`'s back-off ends, so its waiting requests load it then
        (a timer that rings a hair early looks again)."""
        until = self._loop.state.backoff_until(model)
        if until is None:
            return
        left = until - self._loop.clock()
        if left <= 0:
            self._loop.pump()
            return
        self._timers.call_later(max(left / 1e9, 0.001), self.arm_backoff, model)

    def stop(
        self,
        model: str,
        reason: ev.StopReason,
        *,
        evicted_for: str | None = None,
        evicted_by: str | None = None,
    ) -> None:
        began = self._loop.clock()

        def stopped(proc: Upstream, code: int | None) -> None:
            if proc.pid is not None:
                now = self._loop.clock()
                self._loop.emit(
                    [
                        ev.ProcessStopped(
                            at=now,
                            model=model,
                            pid=proc.pid,
                            reason=reason,
                            exit_code=code,
                            evicted_for=evicted_for,
                            evicted_by=evicted_by,
                            duration_ms=(now - began) / 1e6,
                        )
                    ]
                )
            self._loop.pump()

        if self.gpu.telemetry is not None and self.processes.running(model):
            self.measure(model)  # its last chance: the peak includes what it grew to
            self.memory.stopping(model, self.processes.get(model))
        # A sleeping server has no place in the table: stopped all the same.
        aside = self.sleepers.take(model) if self.processes.get(model) is None else None
        if aside is not None:
            self.memory.stopping(model, aside)  # it still holds its CUDA context
        proc = self.processes.stop(model, stopped, aside)
        if proc is None:
            return
        log.info("stopping %s (pid %s): %s", model, proc.pid, reason)
        footprint = self.gpu.stopped(model)
        self._loop.emit(
            [
                ev.ProcessStopping(
                    at=self._loop.clock(),
                    model=model,
                    pid=proc.pid,
                    reason=reason,
                    evicted_for=evicted_for,
                    evicted_by=evicted_by,
                    gpu_memory_mib=footprint,
                )
            ]
        )

    def arm_ttl(self, model: str) -> None:
        ttl = self.spec(model).ttl
        if ttl <= 0:
            return
        self._timers.call_later(ttl, self._ttl_check, model)

    def used(self, model: str) -> None:
        """A request on `model` ended now: its TTL counts from here (or, once a
        reload retired it, it stops now that it is idle)."""
        self._last_used[model] = self._loop.clock()
        if model in self._retiring and not self._loop.state.busy(model):
            self._retiring.discard(model)
            self.stop(model, "reload")
            return
        self.arm_ttl(model)

    def retire(self, models: Iterable[str], before: Mapping[str, ModelConfig]) -> None:
        """A reload removed or changed these models (`before`: the models as
        configured until now): each stops now if idle, else when its last
        running request ends (never mid-request); its next load runs what the
        new config says."""
        for model in models:
            if model not in self.config.models:
                self._removed[model] = before[model]
            if self._loop.state.busy(model):
                self._retiring.add(model)
            else:
                self._retiring.discard(model)
                self.stop(model, "reload")

    def _ttl_check(self, model: str) -> None:
        idle = self.processes.get(model) is not None or model in self.sleepers
        if not idle or self._loop.state.busy(model):
            return  # busy: the request's end arms the TTL again
        ttl = self.spec(model).ttl
        early = ttl - (self._loop.clock() - self._last_used.get(model, 0)) / 1e9
        if early > 0:
            # The timer and the clock may disagree by a hair; look again then.
            self._timers.call_later(early, self._ttl_check, model)
            return
        self.stop(model, "ttl")

    async def shutdown(self) -> None:
        """Stop every upstream (ProcessStopped, reason shutdown) and wait for them."""
        for model in [*self.processes.models(), *self.sleepers.models()]:
            self.stop(model, "shutdown")
        self.memory.close()  # a load waiting for GPU memory ends now, and starts nothing
        # Each load's process is stopped, so it ends now and records how (a load
        # cancelled instead would leave its swap_started unfinished).
        await self.processes.loads_ended()
        for model in self.processes.models():
            self.stop(model, "shutdown")  # one that a load had not spawned yet
        await self.stops_ended("shutdown")
        await self.sleepers.close()

    async def stops_ended(self, reason: ev.StopReason, model: str | None = None) -> list[str]:
        """Wait for the stops and sleeps under way, then stop (for `reason`) and
        wait for each sleeper among them (`model`, None: any): a model whose sleep
        was under way was in neither table when the stops began, and would be
        left asleep. Returns the models stopped so."""
        await self.processes.stops_ended()
        late = [m for m in self.sleepers.models() if model is None or m == model]
        for name in late:
            self.stop(name, reason)
        await self.processes.stops_ended()
        return late


def _off_by_a_tenth(measured: int, declared: int) -> bool:
    return abs(measured - declared) > declared / 10
