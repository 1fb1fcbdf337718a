"""Expected run time of a request, learnt from completed runs of its model and endpoint.

The live server feeds it every completed run (and seeds it from the log at start);
what it expects for a request is recorded in that request's `request_enqueued`
(`expected_run_ns`), so the short-job term and replay use the same number. The
simulator and `generate` feed it the same way. Integer nanoseconds throughout, and
the median of a fixed window, so the same runs always give the same estimate.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Final

WINDOW: Final = 32
"""Completed runs remembered per model and endpoint: recent enough to follow a
change of model settings, enough to ignore one odd run."""


class RunEstimates:
    """Median of the last `WINDOW` run times per (model, endpoint)."""

    def __init__(self) -> None:
        self._runs: dict[tuple[str, str], tuple[deque[int], list[int]]] = {}
        """Per key: the window in arrival order, and the same runs sorted (the
        replay asks at every arrival)."""

    def observe(self, model: str, endpoint: str, run_ns: int) -> None:
        key = (model, endpoint)
        window = self._runs.get(key)
        if window is None:
            window = self._runs[key] = (deque(maxlen=WINDOW), [])
        runs, ordered = window
        if len(runs) == WINDOW:
            ordered.remove(runs[0])  # the run the window is about to forget
        if run_ns < 0:
            run_ns = 0
        runs.append(run_ns)
        bisect.insort(ordered, run_ns)

    def expected(self, model: str, endpoint: str) -> int | None:
        """The (lower) median run time, or None before the first completed run."""
        window = self._runs.get((model, endpoint))
        if window is None:
            return None
        ordered = window[1]
        return ordered[(len(ordered) - 1) // 2]
