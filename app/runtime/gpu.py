"""GPU telemetry: the port, its in-memory stand-in, and each model's footprint.

gpulane reads one GPU's memory and utilization through `GpuTelemetry`: NVML
(`app/runtime/gpu_nvml.py`: `open_nvml`) where an NVIDIA driver is present, `FakeGpu` in
tests. Without either there is no telemetry (None) and everything works as
before: footprints are what models declare (`gpuMemory`), or unknown.

A model's footprint is the most memory it held while resident: the memory of
its process tree's pids as the GPU lists them, or, where no pid matches (a
container, where NVML shows host pids or none), the growth of used memory
around its load. `GpuMemory` keeps both for the run loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import msgspec

from app.config import Config
from app.runtime.process_table import descendants, read_proc

log = logging.getLogger("gpulane.gpu")

MIB = 1024 * 1024


class GpuProcess(msgspec.Struct, frozen=True):
    """A process the GPU lists, and the memory it holds there."""

    pid: int
    used_mib: int


class GpuSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU at one moment."""

    index: int = 0
    name: str = ""
    total_mib: int
    used_mib: int
    utilization_pct: int | None = None
    """Share of the last sample period a kernel ran (NVML); None when unknown."""
    processes: tuple[GpuProcess, ...] = ()

    @property
    def free_mib(self) -> int:
        return max(0, self.total_mib - self.used_mib)

    def held_by(self, pids: Iterable[int]) -> int | None:
        """The memory the GPU lists for `pids`; None when it lists none of them."""
        wanted = set(pids)
        found = [p.used_mib for p in self.processes if p.pid in wanted]
        return sum(found) if found else None

    def holders(self, pids: Iterable[int]) -> list[GpuProcess]:
        """Which of `pids` still hold memory."""
        wanted = set(pids)
        return [p for p in self.processes if p.pid in wanted and p.used_mib > 0]


class GpuTelemetry(Protocol):
    """The port: what gpulane asks of a GPU. Calls are quick and synchronous."""

    def snapshot(self) -> GpuSnapshot: ...
    def close(self) -> None: ...


class FakeGpu:
    """The in-memory stand-in: a GPU of `total_mib` whose memory processes take
    and give back, optionally some time after they exit (`release_after`), as
    some drivers and containers do."""

    def __init__(
        self,
        total_mib: int,
        *,
        name: str = "fake GPU",
        clock: Callable[[], float] = time.monotonic,
        others_mib: int = 0,
    ) -> None:
        self.total_mib = total_mib
        self.name = name
        self.utilization_pct: int | None = 0
        self.others_mib = others_mib
        """Memory taken by processes the GPU does not list (another container)."""
        self._clock = clock
        self._held: dict[int, int] = {}
        self._release_at: dict[int, float] = {}

    def take(self, pid: int, mib: int) -> None:
        self._release_at.pop(pid, None)
        self._held[pid] = self._held.get(pid, 0) + mib

    def give_back(self, pid: int, *, after: float = 0.0) -> None:
        """`pid` frees its memory now, or `after` seconds from now."""
        if after <= 0:
            self._held.pop(pid, None)
            self._release_at.pop(pid, None)
        elif pid in self._held:
            self._release_at[pid] = self._clock() + after

    def snapshot(self) -> GpuSnapshot:
        now = self._clock()
        for pid, at in list(self._release_at.items()):
            if at <= now:
                self._held.pop(pid, None)
                del self._release_at[pid]
        used = min(self.total_mib, self.others_mib + sum(self._held.values()))
        return GpuSnapshot(
            name=self.name,
            total_mib=self.total_mib,
            used_mib=used,
            utilization_pct=self.utilization_pct,
            processes=tuple(GpuProcess(pid, mib) for pid, mib in sorted(self._held.items())),
        )

    def close(self) -> None:
        pass


def tree_pids(pid: int | None) -> set[int]:
    """`pid` and its descendants (the pids a model's server runs as)."""
    if pid is None:
        return set()
    root = read_proc(pid)
    if root is None:
        return {pid}
    found = descendants(root) or []
    return {pid, *(p.pid for p in found)}


class GpuMemory:
    """What the run loop knows of GPU memory: each model's footprint measured so
    far (the most it held while resident), and the snapshot behind it."""

    def __init__(self, telemetry: GpuTelemetry | None) -> None:
        self.telemetry = telemetry
        self._before_load: dict[str, int] = {}
        """Used memory when each model's process was about to start."""
        self._peak: dict[str, int] = {}
        """The most each resident model has held since it started."""
        self.footprints: dict[str, int] = {}
        """Each model's footprint as last measured (kept after it stops)."""

    def snapshot(self) -> GpuSnapshot | None:
        if self.telemetry is None:
            return None
        try:
            return self.telemetry.snapshot()
        except Exception as exc:  # a driver that fails now and then: no figure
            log.warning("GPU telemetry failed: %s", exc)
            return None

    def before_load(self, model: str) -> None:
        """`model`'s process is about to start: the baseline its growth counts from."""
        snap = self.snapshot()
        if snap is not None:
            self._before_load[model] = snap.used_mib

    def measure(self, model: str, pids: Iterable[int]) -> int | None:
        """`model`'s footprint now (MiB): its pids' memory, else the growth of used
        memory since its load began; the most seen while resident. None: no
        telemetry, or nothing it could be told from."""
        snap = self.snapshot()
        if snap is None:
            return None
        held = snap.held_by(pids)
        if held is None:
            base = self._before_load.get(model)
            held = snap.used_mib - base if base is not None and snap.used_mib > base else None
        if held is None:
            return self._peak.get(model)
        peak = max(held, self._peak.get(model, 0))
        self._peak[model] = self.footprints[model] = peak
        return peak

    def stopped(self, model: str) -> int | None:
        """`model` is stopping: its footprint while resident (the peak), forgotten
        for its next start."""
        self._before_load.pop(model, None)
        return self._peak.pop(model, None)


def footprints(config: Config, memory: GpuMemory) -> dict[str, int]:
    """Each model's footprint (MiB) as this server knows it: measured, else
    declared (`gpuMemory`)."""
    declared = {m.id: m.gpu_memory_mib for m in config.models.values() if m.gpu_memory_mib}
    return {**declared, **memory.footprints}


class MemoryStatus(msgspec.Struct, frozen=True, kw_only=True):
    """GPU memory as the console shows it (`Scheduler.memory_status`)."""

    gpu: GpuSnapshot | None
    """The GPU now; None without telemetry."""
    budget_mib: int | None
    """The memory router's budget; None: no memory router."""
    footprints: dict[str, int]
    """Each model's footprint (MiB): measured, else declared."""
    measured: frozenset[str]
    """The models whose footprint was measured (the others' is declared)."""
    resident: tuple[str, ...]
    """The models loaded or loading now, whose footprints fill the bar."""


def memory_status(
    config: Config,
    memory: GpuMemory,
    measured_in_log: Mapping[str, int],
    budget_mib: int | None,
    resident: Iterable[str],
) -> MemoryStatus:
    """What the console shows: `measured_in_log` is what the scheduler state
    folded (this process and, under the memory router, the log before it)."""
    measured = {**measured_in_log, **memory.footprints}
    known = {**footprints(config, memory), **measured}
    return MemoryStatus(
        gpu=memory.snapshot(),
        budget_mib=budget_mib,
        footprints=dict(sorted(known.items())),
        measured=frozenset(measured),
        resident=tuple(resident),
    )
