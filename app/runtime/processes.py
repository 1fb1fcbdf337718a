"""The run loop's effects: the model servers it loads, stops and watches.

The scheduler decides (asking the core: `app.core.loads`) and records; this
carries a decision out and reports each fact back through `ProcessFacts`,
which the scheduler turns into events. Nothing here builds an event or looks
at the queue, as llama-swap's router keeps its `Effects` apart from its
scheduler. A load is a task: it waits for the stops its plan names, then
checks a peer or starts a process and watches it; a stop is a task too, and
several lanes load and stop side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

from app.config import ModelConfig
from app.runtime.peer import probe
from app.runtime.upstream import UpstreamSpec, UpstreamStartError

log = logging.getLogger("gpulane.scheduler")


class Upstream(Protocol):
    """What the run loop needs of one model's server: `UpstreamProcess` in
    production, a recording fake in tests/unit/run_loop_fakes.py."""

    @property
    def spec(self) -> UpstreamSpec: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def cmdline(self) -> list[str]: ...
    @property
    def running(self) -> bool: ...
    @property
    def stopping(self) -> bool: ...
    @property
    def exit_code(self) -> int | None: ...
    @property
    def out_of_memory(self) -> str | None:
        """Its output's recent line saying the GPU ran out of memory, or None."""

    async def start(self) -> int: ...
    async def stop(self) -> int | None: ...
    async def wait_exit(self) -> int: ...


UpstreamFactory = Callable[[ModelConfig, Callable[[Upstream], None]], Upstream]
"""Builds the upstream for a model; the callback records it once it has a pid."""


class ProcessFacts(Protocol):
    """What `Processes` tells the scheduler: each call is one fact to record."""

    def process_spawned(self, model: str, proc: Upstream) -> None: ...
    def load_ended(
        self, model: str, error: str | None, seconds: float, failed: Upstream | None
    ) -> None:
        """`failed`: the process a failed load had spawned (already stopped)."""

    def process_crashed(self, model: str, proc: Upstream, exit_code: int) -> None: ...


class Processes:
    """The upstream processes of this server, by model, and the tasks loading
    and stopping them."""

    def __init__(
        self,
        facts: ProcessFacts,
        new_upstream: UpstreamFactory,
        clock: Callable[[], int],
    ) -> None:
        self._facts = facts
        self.new_upstream = new_upstream
        self._clock = clock
        self.probe_peer: Callable[[ModelConfig], Awaitable[None]] = probe
        """Loads a peer's model: a reachability check (app/runtime/peer.py)."""
        self.before_stop: Callable[[str], Awaitable[None]] | None = None
        """Closes idle connections to a model before it is stopped (serve sets it)."""
        self.wake: Callable[[ModelConfig], Awaitable[Upstream | None]] | None = None
        """Wakes a sleeping server of the model before a load would start one:
        its process, woken, or None to start one (app/runtime/sleepers.py)."""
        self.before_start: Callable[[str], Awaitable[None]] | None = None
        """Runs after a load's stops ended, before its process starts: waits for
        stopped models' GPU memory (`Swaps.memory_back`); raising fails the load."""
        self._upstreams: dict[str, Upstream] = {}
        self._stopping: dict[str, asyncio.Task[None]] = {}
        self._loads: dict[str, asyncio.Task[None]] = {}
        """Loads in progress, by model: one per lane, several lanes in parallel."""
        self._tasks: set[asyncio.Task[Any]] = set()

    def get(self, model: str) -> Upstream | None:
        return self._upstreams.get(model)

    def models(self) -> list[str]:
        """The models with a process (running or starting), in spawn order."""
        return list(self._upstreams)

    def stopping(self) -> frozenset[str]:
        """The models whose stop is in progress."""
        return frozenset(self._stopping)

    def running(self, model: str) -> bool:
        proc = self._upstreams.get(model)
        return proc is not None and proc.running

    def load(self, spec: ModelConfig, wait_for: Iterable[str]) -> None:
        """Wait for the stops `wait_for` names, then check the peer or start the
        process (unless one runs); `load_ended` says how it went."""
        model = spec.id
        task = self._spawn(self._load(spec, tuple(wait_for)))
        self._loads[model] = task
        task.add_done_callback(
            lambda t: self._loads.pop(model) if self._loads.get(model) is t else None
        )

    async def _load(self, spec: ModelConfig, wait_for: tuple[str, ...]) -> None:
        model = spec.id
        t0 = self._clock()
        try:
            for other in wait_for:
                task = self._stopping.get(other)
                if task is not None:
                    await task
            if spec.peer is not None:
                await self.probe_peer(spec)  # no process: is the peer there?
            elif (proc := self._upstreams.get(model)) is None or not proc.running:
                if self.before_start is not None:
                    await self.before_start(model)
                if self.wake is not None and (woken := await self.wake(spec)) is not None:
                    self._upstreams[model] = woken  # its watcher runs since its spawn
                    self._facts.load_ended(model, None, (self._clock() - t0) / 1e9, None)
                    return
                if self.wake is not None and self.before_start is not None:
                    await self.before_start(model)  # a failed wake stopped a sleeper: its memory
                proc = self.new_upstream(spec, lambda p: self._facts.process_spawned(model, p))
                self._upstreams[model] = proc
                await proc.start()
                self._watch(model, proc)
        except Exception as exc:  # any failure must release the waiting requests
            if not isinstance(exc, UpstreamStartError | OSError):
                log.exception("loading %s failed unexpectedly", model)
            failed = self._upstreams.pop(model, None)
            self._facts.load_ended(model, str(exc), (self._clock() - t0) / 1e9, failed)
            return
        self._facts.load_ended(model, None, (self._clock() - t0) / 1e9, None)

    def stop(
        self,
        model: str,
        stopped: Callable[[Upstream, int | None], None],
        aside: Upstream | None = None,
    ) -> Upstream | None:
        """Begin stopping `model`'s process and forget it; `stopped(proc, exit
        code)` once it has exited. None: it has no process. `aside`: a process
        of the model kept out of this table (a sleeping one), stopped instead."""
        proc = self._upstreams.pop(model, None) if aside is None else aside
        if proc is None:
            return None

        async def stop() -> None:
            try:
                if self.before_stop is not None:
                    with contextlib.suppress(Exception):
                        await self.before_stop(model)
                code = await proc.stop()
            finally:
                self._stopping.pop(model, None)
            stopped(proc, code)

        self._stopping[model] = self._spawn(stop())
        return proc

    def put_aside(self, model: str, work: Callable[[Upstream], Awaitable[None]]) -> Upstream | None:
        """Take `model`'s process out of the table and run `work` on it (a sleep)
        as a stop is run: loads that wait for the model's stop wait for it."""
        proc = self._upstreams.pop(model, None)
        if proc is None:
            return None

        async def run() -> None:
            try:
                await work(proc)
            finally:
                self._stopping.pop(model, None)

        self._stopping[model] = self._spawn(run())
        return proc

    def _watch(self, model: str, proc: Upstream) -> None:
        async def watch() -> None:
            code = await proc.wait_exit()
            if proc.stopping or proc.pid is None:
                return
            if self._upstreams.get(model) is proc:
                del self._upstreams[model]
            log.warning("upstream %s (pid %s) exited with %s", model, proc.pid, code)
            self._facts.process_crashed(model, proc, code)

        self._spawn(watch())

    async def loads_ended(self) -> None:
        """Wait for every load in progress to end (each records how)."""
        for load in list(self._loads.values()):
            with contextlib.suppress(Exception):
                await load

    async def stops_ended(self) -> None:
        for task in list(self._stopping.values()):
            with contextlib.suppress(Exception):
                await task

    def kill_all(self) -> None:
        """SIGKILL every process group at once, recording nothing (a fenced server)."""
        for proc in list(self._upstreams.values()):
            if proc.pid is not None:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)  # each upstream leads its own group

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("scheduler task failed", exc_info=task.exception())
