"""`/metrics` gauges of GPU memory: per GPU (total, used, free, utilization) and
per model (its footprint), read at scrape time so they are never stale."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from app.runtime.gpu import MIB, GpuMemory


class GpuCollector(Collector):
    def __init__(self, memory: GpuMemory, footprints: Callable[[], Mapping[str, int]]) -> None:
        """`footprints`: each model's footprint in MiB as the scheduler knows it
        (measured, else declared)."""
        self._memory = memory
        self._footprints = footprints

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._memory.snapshot()
        if snap is not None:
            labels = ["gpu", "name"]
            key = [str(snap.index), snap.name]
            for name, doc, mib in (
                ("total", "The GPU's memory", snap.total_mib),
                ("used", "GPU memory in use (by any process)", snap.used_mib),
                ("free", "GPU memory free", snap.free_mib),
            ):
                gauge = GaugeMetricFamily(f"gpulane_gpu_memory_{name}_bytes", doc, labels=labels)
                gauge.add_metric(key, mib * MIB)
                yield gauge
            if snap.utilization_pct is not None:
                util = GaugeMetricFamily(
                    "gpulane_gpu_utilization_ratio",
                    "Share of the last sample period a kernel ran on the GPU (NVML)",
                    labels=labels,
                )
                util.add_metric(key, snap.utilization_pct / 100)
                yield util
        footprint = GaugeMetricFamily(
            "gpulane_model_gpu_memory_bytes",
            "Each model's footprint: the most GPU memory it held while resident "
            "(measured), else its gpuMemory (declared)",
            labels=["model"],
        )
        for model, mib in sorted(self._footprints().items()):
            footprint.add_metric([model], mib * MIB)
        yield footprint
