"""Measured run and swap times per model, for estimating when a waiting request starts.

Medians of the most recent samples only (app/store/samples.py), so their
cost does not grow with the history. The server keeps one `CachedRunTimes`
and refreshes it at most every few seconds, off the event loop.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterable

import msgspec
from sqlalchemy import Engine

from app.core.run_estimate import WINDOW, Durations
from app.core.scoring import NS_PER_S
from app.store.samples import recent_samples

RECENT_REQUESTS = 2000
"""Finished requests sampled (newest first) for run times."""
RECENT_SWAPS = 500
"""Swaps sampled (newest first) for load times."""


class RunTimes(msgspec.Struct, frozen=True):
    """Median seconds per model; `default_*` for a model with no samples."""

    run_s: dict[str, float] = {}
    swap_s: dict[str, float] = {}
    default_run_s: float = 0.0
    default_swap_s: float = 0.0
    recent_run_s: dict[str, tuple[float, ...]] = {}
    """Per model its last runs, sorted (`recent_by_model`): what a run past its
    expected time is measured against (app/core/start_estimate.py)."""

    def run(self, model: str) -> float:
        return self.run_s.get(model, self.default_run_s)

    def swap(self, model: str) -> float:
        return self.swap_s.get(model, self.default_swap_s)

    def durations(self) -> Durations:
        """The same medians in the estimator's terms (app/core/start_estimate.py)."""
        return Durations(
            {m: _ns(s) for m, s in self.run_s.items()},
            {m: _ns(s) for m, s in self.swap_s.items()},
            _ns(self.default_run_s),
            _ns(self.default_swap_s),
            {m: tuple(_ns(s) for s in runs) for m, runs in self.recent_run_s.items()},
        )


def _ns(seconds: float) -> int:
    return int(seconds * NS_PER_S)


def medians(samples: Iterable[tuple[str, float]]) -> tuple[dict[str, float], float]:
    """Median per key and over all samples (0.0 when there are none)."""
    by_key: dict[str, list[float]] = defaultdict(list)
    every: list[float] = []
    for key, value in samples:
        by_key[key].append(value)
        every.append(value)
    overall = statistics.median(every) if every else 0.0
    return {k: statistics.median(v) for k, v in by_key.items()}, overall


def recent_by_model(samples: Iterable[tuple[str, float]]) -> dict[str, tuple[float, ...]]:
    """Per model its last `WINDOW` samples (given oldest first), sorted: the
    runs the live server's `RunEstimates` would hold."""
    by_model: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=WINDOW))
    for key, value in samples:
        by_model[key].append(value)
    return {k: tuple(sorted(v)) for k, v in by_model.items()}


def load_run_times(engine: Engine) -> RunTimes:
    """Medians of recent completed runs and successful swaps, in seconds."""
    runs, swaps = recent_samples(engine, RECENT_REQUESTS, RECENT_SWAPS)
    run_s, default_run = medians((m, ms / 1000.0) for m, ms in runs)
    swap_s, default_swap = medians((m, ms / 1000.0) for m, ms in swaps)
    recent = recent_by_model((m, ms / 1000.0) for m, ms in runs)
    return RunTimes(run_s, swap_s, default_run, default_swap, recent)


class CachedRunTimes:
    """`load_run_times` at most once per `max_age_s`; `get` blocks (call it in a thread)."""

    def __init__(self, engine: Engine | None, max_age_s: float = 10.0) -> None:
        self._engine = engine
        self._max_age_s = max_age_s
        self._value = RunTimes()
        self._loaded_at: float | None = None
        self._lock = threading.Lock()

    @property
    def current(self) -> RunTimes:
        """The last loaded value, without touching the database."""
        return self._value

    def get(self) -> RunTimes:
        if self._engine is None:
            return self._value
        with self._lock:
            now = time.monotonic()
            if self._loaded_at is None or now - self._loaded_at >= self._max_age_s:
                self._value = load_run_times(self._engine)
                self._loaded_at = now
            return self._value
