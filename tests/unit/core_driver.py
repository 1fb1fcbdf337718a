"""CoreDriver: a SchedulerState, a clock and the decisions made so far, for unit tests.

It feeds the pure core exactly as the run loop does: every change is an event folded in
with `apply`, and `decide` is called until it returns nothing. Swaps and completions are
instant unless a test drives them step by step.
"""

from __future__ import annotations

from collections.abc import Mapping

from app.core import events as ev
from app.core.policy import decide
from app.core.priority import band_of
from app.core.scoring import NS_PER_S, ScoringParams
from app.core.state import SERIAL, SchedulerState, apply

T0 = 1_700_000_000 * NS_PER_S
"""A realistic unix time in ns, so enqueue times are large as in production."""


class CoreDriver:
    """Holds the scheduler state, the clock (`now`) and every ScoresComputed/dispatch."""

    def __init__(
        self,
        params: ScoringParams | None = None,
        *,
        scheduler: str = SERIAL,
        resident: str | None = None,
        model_priority: Mapping[str, int] | None = None,
        concurrency: Mapping[str, int] | None = None,
        now_ns: int = T0,
    ) -> None:
        self.state = SchedulerState(
            params or ScoringParams(),
            scheduler=scheduler,
            model_priority=model_priority,
            concurrency=concurrency,
        )
        self.now = now_ns
        self.scores: list[ev.ScoresComputed] = []
        self.dispatches: list[ev.RequestDispatched] = []
        if resident is not None:
            self.load(resident)

    # -- events in ----------------------------------------------------------

    def apply(self, event: ev.AnyEvent) -> None:
        apply(self.state, event)

    def advance(self, ns: int) -> None:
        assert ns >= 0
        self.now += ns

    def at(self, ns: int) -> None:
        """Set the clock to T0 + ns (may not go back)."""
        assert T0 + ns >= self.now
        self.now = T0 + ns

    def enqueue(self, request_id: str, model: str, priority: int = 0) -> None:
        self.apply(
            ev.RequestEnqueued(
                at=self.now,
                request_id=request_id,
                model=model,
                model_requested=model,
                endpoint="/v1/chat/completions",
                priority=priority,
                band=band_of(priority),
            )
        )

    def start_swap(self, model: str, request_id: str | None = None) -> None:
        self.apply(
            ev.SwapStarted(
                at=self.now, from_model=self.state.resident, to_model=model, request_id=request_id
            )
        )

    def finish_swap(self, model: str) -> None:
        self.apply(ev.SwapFinished(at=self.now, model=model, duration_ms=0.0))

    def load(self, model: str) -> None:
        self.start_swap(model)
        self.finish_swap(model)

    def complete(self, request_id: str) -> None:
        self.apply(ev.RequestCompleted(at=self.now, request_id=request_id, http_status=200))

    def cancel(self, request_id: str) -> None:
        self.apply(ev.RequestCancelled(at=self.now, request_id=request_id, reason="client_gone"))

    # -- decisions ----------------------------------------------------------

    def step(self) -> ev.RequestDispatched | None:
        """One `decide` at `now`; its events are applied and recorded."""
        events = decide(self.state, self.now)
        if not events:
            return None
        scores, dispatched = events
        assert isinstance(scores, ev.ScoresComputed)
        assert isinstance(dispatched, ev.RequestDispatched)
        assert scores.request_id == dispatched.request_id
        for event in events:
            self.apply(event)
        self.scores.append(scores)
        self.dispatches.append(dispatched)
        return dispatched

    def dispatch_all(self) -> list[str]:
        """Call `decide` until it returns nothing; the ids dispatched, in order."""
        out = []
        while (d := self.step()) is not None:
            out.append(d.request_id)
        return out

    def serve_all(self) -> list[str]:
        """Run the serial GPU dry: dispatch, swap when asked (instantly), complete, repeat."""
        out = []
        while (d := self.step()) is not None:
            if d.swap:
                self.start_swap(d.model, d.request_id)
                self.finish_swap(d.model)
            self.complete(d.request_id)
            out.append(d.request_id)
        return out
