"""Wait percentiles per band for the history page's chart. Pure."""

from __future__ import annotations

import math
from collections.abc import Iterable

BANDS = ("interactive", "normal", "batch")
PERCENTILES = (50, 90, 99)


def nearest_rank(ordered: list[float], p: int) -> float:
    """The p-th percentile of sorted values by the nearest-rank method (a value that occurred)."""
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def wait_percentiles(samples: Iterable[tuple[str, float]]) -> dict[str, dict[str, float | int]]:
    """band -> {"count", "p50", "p90", "p99"} in seconds, from (band, wait ms) samples."""
    by_band: dict[str, list[float]] = {}
    for band, ms in samples:
        by_band.setdefault(band, []).append(ms / 1000.0)
    out: dict[str, dict[str, float | int]] = {}
    for band in sorted(by_band, key=lambda b: BANDS.index(b) if b in BANDS else len(BANDS)):
        ordered = sorted(by_band[band])
        row: dict[str, float | int] = {"count": len(ordered)}
        for p in PERCENTILES:
            row[f"p{p}"] = nearest_rank(ordered, p)
        out[band] = row
    return out
