"""What the lane gave to each kind of work, hour by hour: what the forecast of
overtaking work learns from (app/core/overtaking.py).

Per hour of the log (UTC), the lane time taken by the work that arrived in
that hour: each request's run, keyed by its model and priority, and each
model load, keyed by the loaded model and the priority of the request it was
for. The live server feeds it every event it records (`observe`, with the
state before the event applies) and seeds it from the log's last week at
start (`learn`); `bench.eta_bench` feeds it the same events. A week is kept.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from app.core import events as ev
from app.core.scoring import NS_PER_S
from app.core.state import SchedulerState

HOUR_NS: Final = 3600 * NS_PER_S
DAY_HOURS: Final = 24
DAYS: Final = 7
"""Earlier days remembered: a week, the same hours of each."""

Key = tuple[str, int, bool]
"""(model, priority, a load rather than a run)."""


class Sums:
    """How many, their total and their total of squares (seconds)."""

    __slots__ = ("n", "s", "s2")

    def __init__(self) -> None:
        self.n = 0
        self.s = 0.0
        self.s2 = 0.0

    def add(self, seconds: float) -> None:
        self.n += 1
        self.s += seconds
        self.s2 += seconds * seconds


class LaneHistory:
    """Lane time taken per hour of the log (see the module's docstring)."""

    def __init__(self) -> None:
        self.first_ns: int | None = None
        """When the log begins: hours before it are not known, not empty."""
        self.hours: dict[int, dict[Key, Sums]] = {}
        """Hour (unix ns // HOUR_NS) of a request's arrival or a load's start ->
        what it took."""
        self.models: set[str] = set()
        self._newest = 0
        self._started: dict[str, int] = {}
        self._loading: dict[str, tuple[int, int]] = {}
        """Model -> (its load's start, the priority of the request it is for)."""

    def begins(self, first_ns: int) -> None:
        """The log begins at `first_ns` (a seed's first event)."""
        self.first_ns = first_ns if self.first_ns is None else min(self.first_ns, first_ns)

    def learn(
        self,
        first_s: float | None,
        runs: Iterable[tuple[float, str, int, float]],
        loads: Iterable[tuple[float, str, int | None, float]],
    ) -> None:
        """Seed from the log (seconds, ms, as the store reads them): when it
        begins, (enqueued at, model, priority, run ms) of each run, and (started
        at, model, the priority of the request it was for, load ms) of each load."""
        if first_s is not None:
            self.begins(int(first_s * NS_PER_S))
        for at, model, priority, ms in runs:
            self.add_run(int(at * NS_PER_S), model, priority, int(ms * 1e6))
        for at, model, trigger, ms in loads:
            self.add_load(int(at * NS_PER_S), model, trigger or 0, int(ms * 1e6))

    def add_run(self, enqueued_ns: int, model: str, priority: int, run_ns: int) -> None:
        self._add(enqueued_ns, (model, priority, False), run_ns)

    def add_load(self, started_ns: int, model: str, priority: int, load_ns: int) -> None:
        self._add(started_ns, (model, priority, True), load_ns)

    def _add(self, at_ns: int, key: Key, ns: int) -> None:
        hour = at_ns // HOUR_NS
        if hour < self._newest - DAYS * DAY_HOURS - 1:
            return
        self.models.add(key[0])
        self.hours.setdefault(hour, {}).setdefault(key, Sums()).add(max(0, ns) / NS_PER_S)
        if hour > self._newest:
            self._newest = hour
            cut = hour - DAYS * DAY_HOURS - 1  # the week before, and the hour in progress
            for old in [h for h in self.hours if h < cut]:
                del self.hours[old]

    def observe(self, event: ev.AnyEvent, state: SchedulerState) -> None:
        """Learn from `event`, with `state` as it was before the event applied."""
        if self.first_ns is None:
            self.first_ns = event.at
        if isinstance(event, ev.RequestStarted):
            self._started[event.request_id] = event.at
        elif isinstance(event, ev.RequestCompleted | ev.RequestFailed | ev.RequestCancelled):
            began = self._started.pop(event.request_id, None)
            request = state.requests.get(event.request_id)
            run_ms = event.run_ms if isinstance(event, ev.RequestCompleted) else None
            if request is None or (began is None and run_ms is None):
                return  # never ran: it took no lane time
            run_ns = int(run_ms * 1e6) if run_ms is not None else event.at - (began or event.at)
            model = state.running.get(event.request_id, request.model)
            self.add_run(request.enqueued_ns, model, request.priority, run_ns)
        elif isinstance(event, ev.RequestRequeued | ev.RequestAbandoned):
            self._started.pop(event.request_id, None)
        elif isinstance(event, ev.SwapStarted):
            request = state.requests.get(event.request_id or "")
            priority = request.priority if request is not None else 0
            self._loading[event.to_model] = (event.at, priority)
        elif isinstance(event, ev.SwapFinished):
            load = self._loading.pop(event.model, None)
            if load is not None:
                self.add_load(load[0], event.model, load[1], int(event.duration_ms * 1e6))
        elif isinstance(event, ev.SwapFailed):
            self._loading.pop(event.model, None)

    def run_stats(self, model: str, priority: int) -> tuple[int, float, float]:
        """(how many, mean s, variance s²) of the runs of `model` at `priority`
        the log holds: a run's own jobs, apart from the model's other work."""
        n, total, squares = 0, 0.0, 0.0
        for sums in self.hours.values():
            found = sums.get((model, priority, False))
            if found is not None:
                n, total, squares = n + found.n, total + found.s, squares + found.s2
        if n == 0:
            return 0, 0.0, 0.0
        mean = total / n
        return n, mean, max(0.0, squares / n - mean * mean)
