"""Memory back before the next load: a load waits until stopped models' GPU
memory is free again.

Some drivers and containers free a process's memory some time after it exits
(llama-swap #97, #158: the next model then fails with out-of-memory). With GPU
telemetry, every process of a stopped model is remembered; before a load starts
its process, it waits while the GPU still lists any of them holding memory, at
most `memoryReleaseWait` seconds. The wait and its end are recorded
(`memory_wait_started`, `memory_wait_ended`). Still held then, the load fails
(`UpstreamStartError` naming each holder's pid and model), so it goes through
the load back-off and its requests get that error. Without telemetry nothing
waits, as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Final, Protocol

from app.config import Config
from app.core import events as ev
from app.runtime.gpu import GpuMemory, tree_pids
from app.runtime.ports import Timers
from app.runtime.processes import Upstream
from app.runtime.upstream import UpstreamStartError

log = logging.getLogger("gpulane.scheduler")

POLL_S: Final = 0.1
"""How often the GPU is asked again while a load waits (NVML answers in about a ms)."""


class _Swaps(Protocol):
    gpu: GpuMemory
    config: Config


class _Loop(Protocol):
    clock: Callable[[], int]

    def emit(self, events: Iterable[ev.AnyEvent]) -> asyncio.Future[list[int]]: ...


class MemoryRelease:
    def __init__(self, swaps: _Swaps, loop: _Loop, timers: Timers) -> None:
        self._swaps = swaps
        self._loop = loop
        self._timers = timers
        self._stopped: dict[int, str] = {}
        """pid -> the stopped model it belonged to, until the GPU lists it no more."""
        self._closed: asyncio.Future[None] | None = None
        """Done once gpulane stops: a waiting load ends at once."""

    def close(self) -> None:
        """gpulane stops: a load waiting for memory fails now instead of starting."""
        if self._closed is None:
            self._closed = asyncio.get_running_loop().create_future()
        if not self._closed.done():
            self._closed.set_result(None)

    def stopping(self, model: str, proc: Upstream | None) -> None:
        """`model`'s process is being stopped (or has exited): remember its pids."""
        if proc is None or proc.pid is None or self._swaps.gpu.telemetry is None:
            return
        for pid in tree_pids(proc.pid):
            self._stopped[pid] = model

    def stopped_pids(self) -> list[int]:
        """The processes of stopped models not yet seen to free their memory."""
        return list(self._stopped)

    def holders(self) -> list[ev.MemoryHolder]:
        """Processes of stopped models the GPU still lists with memory; the others
        are forgotten."""
        if not self._stopped:
            return []
        snap = self._swaps.gpu.snapshot()
        if snap is None:
            return []
        held = snap.holders(self._stopped)
        still = {p.pid for p in held}
        for pid in [p for p in self._stopped if p not in still]:
            del self._stopped[pid]
        return [
            ev.MemoryHolder(pid=p.pid, model=self._stopped[p.pid], mib=p.used_mib) for p in held
        ]

    async def wait(self, model: str) -> None:
        """Before `model`'s process starts: wait until no stopped model's process
        holds GPU memory, at most `memoryReleaseWait`; raise when one still does."""
        holders = self.holders()
        if not holders:
            return
        limit = self._swaps.config.memory_release_wait
        clock = self._loop.clock
        began = clock()
        log.info("loading %s waits for GPU memory still held by %s", model, _named(holders))
        self._loop.emit(
            [ev.MemoryWaitStarted(at=began, model=model, holders=holders, limit_ms=limit * 1000)]
        )
        while holders and not self.closed:
            left = limit - (clock() - began) / 1e9
            if left <= 0:
                break
            await self._sleep(min(POLL_S, left))
            holders = self.holders()
        waited_ms = (clock() - began) / 1e6
        self._loop.emit(
            [
                ev.MemoryWaitEnded(
                    at=clock(),
                    model=model,
                    released=not holders,
                    waited_ms=waited_ms,
                    holders=holders,
                )
            ]
        )
        if self.closed:
            raise UpstreamStartError("gpulane is stopping", model_id=model)
        if holders:
            raise UpstreamStartError(
                f"GPU memory was not released: {_named(holders)} {limit:g} s after it was "
                f"stopped (memoryReleaseWait), so {model!r} was not started (it would run "
                "out of memory)",
                model_id=model,
            )

    @property
    def closed(self) -> bool:
        return self._closed is not None and self._closed.done()

    async def _sleep(self, seconds: float) -> None:
        """`seconds` on the timers (a fake clock in tests), or until gpulane stops."""
        if self._closed is None:
            self._closed = asyncio.get_running_loop().create_future()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def ring() -> None:
            if not done.done():
                done.set_result(None)

        handle = self._timers.call_later(seconds, ring)
        try:
            await asyncio.wait({done, self._closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            handle.cancel()


def _named(holders: list[ev.MemoryHolder]) -> str:
    return ", ".join(f"pid {h.pid} (model {h.model!r}) still holds {h.mib} MiB" for h in holders)
