"""`--verify`: does the core, given the log, make every recorded decision?

The recorded events are folded in seq order with `app.core.state.apply`, into a fresh
`SchedulerState` at each `server_started` (with the parameters it carries), exactly as
the live run loop built its state. At each recorded decision (`scores_computed`, then
its `request_dispatched`) `decide(state, that event's at)` must pick the same request
(and the same swap flag). The first disagreement is reported with both candidates and
both score breakdowns. A log that passes is complete and the core deterministic.

fifo logs do not record per-model priorities or concurrency limits; they are inferred
from the decisions (winner's queue priority minus its header priority; the most
requests seen in flight on a model).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from app.core import events as ev
from app.core.policy import decide
from app.core.scoring import Breakdown, ScoringParams
from app.core.state import SERIAL, SchedulerState, apply


@dataclass(frozen=True)
class Divergence:
    seq: int
    at: int
    recorded_id: str
    recorded: Breakdown | None
    simulated_id: str | None
    simulated: Breakdown | None
    recorded_as_simulated: Breakdown | None
    """The recorded winner scored by the simulation, when it was still queued."""
    detail: str
    queue_depth: int
    resident: str | None

    def describe(self) -> str:
        lines = [
            f"first divergence at seq {self.seq} (at {self.at} ns): {self.detail}",
            f"  queue depth {self.queue_depth}, resident model {self.resident}",
            f"  recorded : {self.recorded_id}  {_fmt(self.recorded)}",
        ]
        if self.recorded_as_simulated is not None:
            lines.append(
                f"             as the simulation scores it: {_fmt(self.recorded_as_simulated)}"
            )
        lines.append(f"  simulated: {self.simulated_id or '(nothing)'}  {_fmt(self.simulated)}")
        return "\n".join(lines)


@dataclass(frozen=True)
class VerifyResult:
    decisions: int
    events: int
    divergence: Divergence | None

    @property
    def ok(self) -> bool:
        return self.divergence is None


def _fmt(b: Breakdown | None) -> str:
    if b is None:
        return ""
    return (
        f"score {b.total:.6f} = priority {b.priority} + affinity {b.affinity} + aging {b.aging:.6f}"
    )


def verify(events: Iterable[tuple[int, ev.AnyEvent]]) -> VerifyResult:
    """Check every recorded decision of a log given as (seq, event) in seq order."""
    items = list(events)
    model_priority, concurrency = _fifo_settings(items)
    state: SchedulerState | None = None
    decisions = 0
    pending: tuple[int, ev.ScoresComputed, list[ev.AnyEvent]] | None = None
    for seq, e in items:
        if isinstance(e, ev.ServerStarted):
            state = _fresh(e.scheduler, ScoringParams(e.aging_divisor_ns, e.swap_affinity_bonus))
            state.model_priority.update(model_priority)
            state.concurrency.update(concurrency)
        elif state is None and isinstance(e, ev.ScoresComputed):
            # A log without server_started: the decision carries the parameters.
            state = _fresh(e.scheduler, ScoringParams(e.aging_divisor_ns, e.swap_affinity_bonus))
        if state is None:
            state = _fresh(SERIAL, ScoringParams())
        if isinstance(e, ev.ScoresComputed):
            decisions += 1
            simulated = decide(state, e.at)
            found = _compare(seq, e, state, simulated)
            if found is not None:
                return VerifyResult(decisions, seq, found)
            pending = (seq, e, simulated)
        elif isinstance(e, ev.RequestDispatched) and pending is not None:
            pseq, scores, simulated = pending
            pending = None
            sim = simulated[1]
            assert isinstance(sim, ev.RequestDispatched)
            if e.request_id != scores.request_id or e.swap != sim.swap:
                detail = (
                    f"dispatched {e.request_id} (swap={e.swap}) after scoring "
                    f"{scores.request_id}; the simulation dispatches {sim.request_id} "
                    f"(swap={sim.swap})"
                )
                return VerifyResult(
                    decisions, seq, _divergence(seq, e.at, scores, state, simulated, detail)
                )
        apply(state, e)
    return VerifyResult(decisions, len(items), None)


def _fresh(scheduler: str, params: ScoringParams) -> SchedulerState:
    return SchedulerState(params, scheduler=scheduler)


def _compare(
    seq: int, scores: ev.ScoresComputed, state: SchedulerState, simulated: list[ev.AnyEvent]
) -> Divergence | None:
    if not simulated:
        return _divergence(
            seq, scores.at, scores, state, simulated, "the simulation dispatches nothing"
        )
    sim_scores = simulated[0]
    assert isinstance(sim_scores, ev.ScoresComputed)
    if sim_scores.request_id != scores.request_id:
        return _divergence(seq, scores.at, scores, state, simulated, "a different request wins")
    return None


def _divergence(
    seq: int,
    at: int,
    scores: ev.ScoresComputed,
    state: SchedulerState,
    simulated: list[ev.AnyEvent],
    detail: str,
) -> Divergence:
    sim_scores = simulated[0] if simulated else None
    assert sim_scores is None or isinstance(sim_scores, ev.ScoresComputed)
    queued = state.queue.get(scores.request_id)
    as_sim = None
    if queued is not None:
        as_sim = state.queue.params.breakdown(
            queued.priority, queued.enqueued_ns, at, queued.model == state.resident
        )
    return Divergence(
        seq=seq,
        at=at,
        recorded_id=scores.request_id,
        recorded=scores.winner,
        simulated_id=None if sim_scores is None else sim_scores.request_id,
        simulated=None if sim_scores is None else sim_scores.winner,
        recorded_as_simulated=as_sim,
        detail=detail
        if queued is not None
        else f"{detail} (the recorded winner is not queued here)",
        queue_depth=len(state.queue),
        resident=state.resident,
    )


def _fifo_settings(items: list[tuple[int, ev.AnyEvent]]) -> tuple[dict[str, int], dict[str, int]]:
    """Per-model queue priority and concurrency limit, inferred from a fifo log."""
    if not any(isinstance(e, ev.ServerStarted) and e.scheduler != SERIAL for _, e in items):
        return {}, {}
    header: dict[str, tuple[str, int]] = {}
    model_priority: dict[str, int] = {}
    in_flight: dict[str, set[str]] = {}
    concurrency: dict[str, int] = {}
    for _, e in items:
        match e:
            case ev.RequestEnqueued():
                header[e.request_id] = (e.model, e.priority)
            case ev.ScoresComputed() if e.request_id in header:
                model, priority = header[e.request_id]
                model_priority.setdefault(model, e.winner.priority - priority)
            case ev.RequestDispatched():
                running = in_flight.setdefault(e.model, set())
                running.add(e.request_id)
                concurrency[e.model] = max(concurrency.get(e.model, 1), len(running))
            case (
                ev.RequestCompleted()
                | ev.RequestFailed()
                | ev.RequestCancelled()
                | ev.RequestAbandoned()
            ):
                for running in in_flight.values():
                    running.discard(e.request_id)
            case ev.ServerStarted():
                in_flight.clear()
            case _:
                pass
    return model_priority, concurrency
