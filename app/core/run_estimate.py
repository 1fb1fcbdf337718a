"""Expected run time of a request, learnt from completed runs of its model and endpoint,
and each model's run and load times (`Durations`), learnt the same way.

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

import msgspec

WINDOW: Final = 32
"""Completed runs remembered per model and endpoint: recent enough to follow a
change of model settings, enough to ignore one odd run."""


class Durations(msgspec.Struct, frozen=True):
    """Each model's run and load time (ns), for estimating when work starts and
    ends (app/core/start_estimate.py); `default_*` for a model never seen."""

    run_ns: dict[str, int] = {}
    load_ns: dict[str, int] = {}
    default_run_ns: int = 0
    default_load_ns: int = 0
    runs_seen_ns: dict[str, tuple[int, ...]] = {}
    """Per model its last runs (any endpoint), sorted: what a run that outlives
    its expected one is measured against (`longer_than`)."""
    wake_ns: dict[str, int] = {}
    """Each model's wake (a sleeping server's load), learnt apart from its cold loads."""
    asleep: frozenset[str] = frozenset()
    """Models whose server sleeps now: their load is a wake."""

    def run(self, model: str) -> int:
        return self.run_ns.get(model, self.default_run_ns)

    def longer_than(self, model: str, ran_ns: int) -> tuple[int, ...]:
        """The last runs of `model` that lasted longer than `ran_ns`, sorted:
        none once a run has outlived every one (or its model has none)."""
        seen = self.runs_seen_ns.get(model, ())
        return seen[bisect.bisect_right(seen, ran_ns) :]

    def load(self, model: str) -> int:
        """What loading `model` now takes: its wake when it sleeps (and a wake was
        seen), else its load."""
        if model in self.asleep:
            wake = self.wake_ns.get(model)
            if wake is not None:
                return wake
        return self.load_ns.get(model, self.default_load_ns)

    def of(self, model: str, expected_run_ns: int | None) -> int:
        """A request's run: its own learnt expectation (recorded at enqueue), else
        its model's."""
        return self.run(model) if expected_run_ns is None else expected_run_ns


_Window = tuple[deque[int], list[int]]
"""A window in arrival order, and the same values sorted."""


def _add(windows: dict[tuple[str, str], _Window], key: tuple[str, str], value: int) -> None:
    window = windows.get(key)
    if window is None:
        window = windows[key] = (deque(maxlen=WINDOW), [])
    values, ordered = window
    if len(values) == WINDOW:
        ordered.remove(values[0])  # the value the window is about to forget
    values.append(max(0, value))
    bisect.insort(ordered, max(0, value))


def _median(ordered: list[int]) -> int:
    return ordered[(len(ordered) - 1) // 2]


class RunEstimates:
    """Median of the last `WINDOW` run times per (model, endpoint), and per model
    the last `WINDOW` runs (any endpoint) and loads: `durations()`."""

    def __init__(self) -> None:
        self._runs: dict[tuple[str, str], _Window] = {}
        """Per key: the window in arrival order, and the same runs sorted (the
        replay asks at every arrival)."""
        self._model_runs: dict[tuple[str, str], _Window] = {}
        self._loads: dict[tuple[str, str], _Window] = {}
        self._wakes: dict[tuple[str, str], _Window] = {}

    def observe(self, model: str, endpoint: str, run_ns: int) -> None:
        _add(self._runs, (model, endpoint), run_ns)
        _add(self._model_runs, (model, ""), run_ns)

    def observe_load(self, model: str, load_ns: int, *, woke: bool = False) -> None:
        """A load of `model` that succeeded, taking `load_ns`; `woke`: it woke a
        sleeping server (learnt as its wake, not its load)."""
        _add(self._wakes if woke else self._loads, (model, ""), load_ns)

    def expected(self, model: str, endpoint: str) -> int | None:
        """The (lower) median run time, or None before the first completed run."""
        window = self._runs.get((model, endpoint))
        return None if window is None else _median(window[1])

    def durations(self, asleep: frozenset[str] = frozenset()) -> Durations:
        """Per model the (lower) median of its last runs, loads and wakes, and
        those runs sorted; for a model never seen, the lower median of those
        medians (0 before any). `asleep`: the models whose load is a wake now."""
        runs = {m: _median(w[1]) for (m, _), w in self._model_runs.items()}
        loads = {m: _median(w[1]) for (m, _), w in self._loads.items()}
        wakes = {m: _median(w[1]) for (m, _), w in self._wakes.items()}
        return Durations(
            runs,
            loads,
            _median(sorted(runs.values())) if runs else 0,
            _median(sorted(loads.values())) if loads else 0,
            {m: tuple(w[1]) for (m, _), w in self._model_runs.items()},
            wake_ns=wakes,
            asleep=asleep,
        )
