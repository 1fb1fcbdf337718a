"""A fake GPU shared between processes, for end-to-end tests and demos without
a GPU: `GPULANE_FAKE_GPU=DIR:TOTAL_MIB` makes `gpulane serve` read it instead
of NVML, and `tools/fake_upstream.py --gpu-dir DIR --gpu-mib N` takes memory in
it at start and gives it back at its exit (`--gpu-release-after S`: S seconds
later, or `never`).

Each process holding memory is one file `DIR/PID.json`: `{"mib": N}`, plus
`"free_at"` (unix seconds) once it has exited and frees it later. A file past
its `free_at` counts no more (and is removed).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Final

from app.runtime.gpu import GpuProcess, GpuSnapshot

log = logging.getLogger("gpulane.gpu")

ENV: Final = "GPULANE_FAKE_GPU"


class FileGpu:
    def __init__(self, directory: str | Path, total_mib: int) -> None:
        self.directory = Path(directory)
        self.total_mib = total_mib
        self.directory.mkdir(parents=True, exist_ok=True)

    def snapshot(self) -> GpuSnapshot:
        now = time.time()
        held: list[GpuProcess] = []
        for path in sorted(self.directory.glob("*.json")):
            try:
                entry = json.loads(path.read_text())
                pid = int(path.stem)
            except (OSError, ValueError):
                continue  # being written, or not ours
            free_at = entry.get("free_at")
            if free_at is not None and free_at <= now:
                path.unlink(missing_ok=True)
                continue
            held.append(GpuProcess(pid, int(entry["mib"])))
        used = min(self.total_mib, sum(p.used_mib for p in held))
        return GpuSnapshot(
            name="fake GPU (files)",
            total_mib=self.total_mib,
            used_mib=used,
            utilization_pct=None,
            processes=tuple(held),
        )

    def close(self) -> None:
        pass


def from_environment() -> FileGpu | None:
    """The fake GPU `GPULANE_FAKE_GPU=DIR:TOTAL_MIB` names, or None."""
    value = os.environ.get(ENV)
    if not value:
        return None
    directory, _, total = value.rpartition(":")
    try:
        gpu = FileGpu(directory, int(total))
    except (ValueError, OSError) as exc:
        log.warning("%s=%r is not DIR:TOTAL_MIB (%s): no fake GPU", ENV, value, exc)
        return None
    log.info("GPU telemetry: a fake GPU of %d MiB in %s (%s)", gpu.total_mib, directory, ENV)
    return gpu
