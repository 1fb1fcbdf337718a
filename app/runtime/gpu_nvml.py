"""GPU telemetry through NVML (`nvidia-ml-py`), for NVIDIA GPUs.

Imported where serve opens telemetry (`open_nvml`), so a machine without the package or a
driver pays nothing: `open_nvml` logs one line and returns None. One GPU (index
0, as `CUDA_VISIBLE_DEVICES` leaves it); several GPUs come later.
"""

from __future__ import annotations

import logging
from typing import Any

from app.runtime.gpu import MIB, GpuProcess, GpuSnapshot

log = logging.getLogger("gpulane.gpu")


class NvmlTelemetry:
    def __init__(self, nvml: Any, index: int = 0) -> None:
        self._nvml = nvml
        self.index = index
        self._handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = nvml.nvmlDeviceGetName(self._handle)
        self.name = name.decode() if isinstance(name, bytes) else str(name)

    def snapshot(self) -> GpuSnapshot:
        nvml, handle = self._nvml, self._handle
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            utilization: int | None = int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except nvml.NVMLError:
            utilization = None
        held: dict[int, int] = {}
        for listing in (
            nvml.nvmlDeviceGetComputeRunningProcesses,
            nvml.nvmlDeviceGetGraphicsRunningProcesses,
        ):
            try:
                processes = listing(handle)
            except nvml.NVMLError:
                continue
            for proc in processes:
                used = proc.usedGpuMemory  # None where the driver will not say (containers)
                held[proc.pid] = max(held.get(proc.pid, 0), (used or 0) // MIB)
        return GpuSnapshot(
            index=self.index,
            name=self.name,
            total_mib=memory.total // MIB,
            used_mib=memory.used // MIB,
            utilization_pct=utilization,
            processes=tuple(GpuProcess(pid, mib) for pid, mib in sorted(held.items())),
        )

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass


def open_nvml(index: int = 0) -> NvmlTelemetry | None:
    """NVML's view of GPU `index`, or None (one log line) without a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # no package, no library, no driver, no device
        log.info("no GPU telemetry (NVML: %s): footprints are declared ones only", exc)
        return None
    try:
        telemetry = NvmlTelemetry(pynvml, index)
        telemetry.snapshot()
    except Exception as exc:
        log.info("no GPU telemetry (NVML GPU %d: %s)", index, exc)
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
        return None
    log.info("GPU telemetry: NVML, GPU %d (%s)", index, telemetry.name)
    return telemetry
