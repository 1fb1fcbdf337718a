"""What each swap action costs each model now, learnt from the log.

Every stop, cold start, sleep and wake is in the log with its time
(docs/events.md): a stop from its `process_stopping` to its `process_stopped`
(`duration_ms`), a cold start from its `process_started` to the load's
`swap_finished` (the process's own start, not the wait for what the load
evicted), a sleep's and a wake's `duration_ms` (`process_slept`,
`process_woken`). A model's current cost of an action is the (lower) median of
its last `WINDOW` ones: recent enough to follow a new model version or a
changed machine, steady against one odd swap. Integer nanoseconds, so the same
log always gives the same costs.

Readers: explain ("woke qwen in 1.2 s", "a cold start of flux costs 48 s: it
was put to sleep instead"), the replay's what-if (tools/replay/sleep_whatif.py)
and the sleep benchmark. Pure: fed events, no clock.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from typing import Final, Literal

import msgspec

from app.core import events as ev

WINDOW: Final = 16
"""Actions remembered per model and kind."""

Action = Literal["start", "stop", "sleep", "wake"]
ACTIONS: Final[tuple[Action, ...]] = ("start", "stop", "sleep", "wake")


class ActionCosts(msgspec.Struct, frozen=True):
    """One model's current cost of each action, ns (None: never seen)."""

    start_ns: int | None = None
    stop_ns: int | None = None
    sleep_ns: int | None = None
    wake_ns: int | None = None

    def of(self, action: Action) -> int | None:
        value: int | None = getattr(self, f"{action}_ns")
        return value

    def swap_out_ns(self, sleeps: bool) -> int | None:
        """What evicting it costs: its sleep when it sleeps (and one was seen), else its stop."""
        return self.sleep_ns if sleeps and self.sleep_ns is not None else self.stop_ns

    def swap_in_ns(self, asleep: bool) -> int | None:
        """What loading it costs: its wake when it is asleep (and one was seen), else a
        cold start."""
        return self.wake_ns if asleep and self.wake_ns is not None else self.start_ns


class SwapCosts:
    """Each model's recent stops, cold starts, sleeps and wakes, fed event by event."""

    def __init__(self) -> None:
        self._windows: dict[tuple[str, Action], tuple[deque[int], list[int]]] = {}
        self._spawned: dict[str, int] = {}
        """Model -> when its process was spawned, until its load ends."""
        self._stopping: dict[tuple[str, int | None], int] = {}
        """(model, pid) -> when its stop began (for a log without `duration_ms`)."""

    def observe(self, event: ev.AnyEvent) -> None:
        match event:
            case ev.ProcessStarted():
                self._spawned[event.model] = event.at
            case ev.SwapFinished():
                spawned = self._spawned.pop(event.model, None)
                if spawned is not None:
                    self._add(event.model, "start", event.at - spawned)
            case ev.SwapFailed():
                self._spawned.pop(event.model, None)
            case ev.ProcessStopping():
                self._stopping[(event.model, event.pid)] = event.at
            case ev.ProcessStopped():
                began = self._stopping.pop((event.model, event.pid), None)
                if event.duration_ms is not None:
                    self._add(event.model, "stop", round(event.duration_ms * 1e6))
                elif began is not None and event.reason != "crashed":
                    self._add(event.model, "stop", event.at - began)
            case ev.ProcessSlept():
                self._add(event.model, "sleep", round(event.duration_ms * 1e6))
            case ev.ProcessWoken():
                self._add(event.model, "wake", round(event.duration_ms * 1e6))
            case ev.ServerStarted():
                # A new process: no load or stop of the last one is still going on.
                self._spawned.clear()
                self._stopping.clear()
            case _:
                pass

    def _add(self, model: str, action: Action, ns: int) -> None:
        window = self._windows.get((model, action))
        if window is None:
            window = self._windows[(model, action)] = (deque(maxlen=WINDOW), [])
        values, ordered = window
        if len(values) == WINDOW:
            ordered.remove(values[0])
        values.append(max(0, ns))
        bisect.insort(ordered, max(0, ns))

    def costs(self, model: str) -> ActionCosts:
        """`model`'s current cost of each action: the lower median of its last ones."""
        out: dict[str, int] = {}
        for action in ACTIONS:
            window = self._windows.get((model, action))
            if window is not None:
                ordered = window[1]
                out[f"{action}_ns"] = ordered[(len(ordered) - 1) // 2]
        return ActionCosts(**out)

    def count(self, model: str, action: Action) -> int:
        """How many of `model`'s `action`s are in its window."""
        window = self._windows.get((model, action))
        return 0 if window is None else len(window[0])

    def models(self) -> list[str]:
        return sorted({m for m, _ in self._windows})

    def table(self) -> dict[str, ActionCosts]:
        return {m: self.costs(m) for m in self.models()}


def swap_costs(events: Iterable[ev.AnyEvent]) -> SwapCosts:
    """The costs a log's events teach, in log order."""
    costs = SwapCosts()
    for event in events:
        costs.observe(event)
    return costs


def seconds(ns: int) -> str:
    """`ns` for a sentence: `1.2 s`, `48 s`, `350 ms`."""
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.0f} ms"
    return f"{ns / 1e9:.1f} s" if ns < 10_000_000_000 else f"{ns / 1e9:.0f} s"


def woke(model: str, ns: int) -> str:
    return f"woke {model} in {seconds(ns)}"


def slept_instead(model: str, costs: ActionCosts) -> str:
    """Why an evicted model was put to sleep, in what its cold start would cost."""
    if costs.start_ns is None:
        return f"{model} was put to sleep instead of stopped"
    return f"a cold start of {model} costs {seconds(costs.start_ns)}: it was put to sleep instead"
