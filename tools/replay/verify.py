"""`--verify`: does the core, given the log, make every recorded decision?

The whole log is folded in seq order with `app.core.state.apply` into one
`SchedulerState`, exactly as the live run loop built its state: each
`server_started` carries the scheduler and all its parameters (fifo priorities and
limits included), and what recovery put back is in the log (`request_restored`;
app/core/state.py says how older logs fold). At each recorded decision
(`scores_computed`, then its `request_dispatched`) `decide(state, that event's at)`
must pick the same request (and the same swap flag). The first disagreement is
reported with both candidates and both score breakdowns. A log that passes is
complete and the core deterministic.

A log without `server_started` (synthetic, truncated) is folded as if one stood
at its start with the parameters its first decision records.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from app.core import events as ev
from app.core.policy import Decision, decide
from app.core.scoring import Breakdown
from app.core.state import SchedulerState, apply


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
    text = f"score {b.total:.6f} = priority {b.priority} + affinity {b.affinity}"
    if b.fair_share:
        text += f" + fair share {b.fair_share:.6f}"
    if b.short_job:
        text += f" + short job {b.short_job:.6f}"
    return text + f" + aging {b.aging:.6f}"


def verify(events: Iterable[tuple[int, ev.AnyEvent]]) -> VerifyResult:
    """Check every recorded decision of a log given as (seq, event) in seq order."""
    state = SchedulerState()
    decisions = 0
    count = 0
    pending: tuple[int, ev.ScoresComputed, Decision | None] | None = None
    for seq, e in _with_start(events):
        count += seq > 0
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
            assert simulated is not None  # else _compare returned a divergence
            sim = simulated.dispatched
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
    return VerifyResult(decisions, count, None)


def _with_start(
    events: Iterable[tuple[int, ev.AnyEvent]],
) -> Iterator[tuple[int, ev.AnyEvent]]:
    """The log, led by a `server_started` built from its first decision when no
    `server_started` comes before that decision (seq 0: it is not in the log)."""
    held: list[tuple[int, ev.AnyEvent]] = []
    it = iter(events)
    for seq, e in it:
        if isinstance(e, ev.ScoresComputed):
            yield 0, _started_as_recorded(e, held[0][1].at if held else e.at)
        if isinstance(e, ev.ServerStarted | ev.ScoresComputed):
            yield from held
            yield seq, e
            yield from it
            return
        held.append((seq, e))
    yield from held


def _started_as_recorded(scores: ev.ScoresComputed, at: int) -> ev.ServerStarted:
    return ev.ServerStarted(
        at=at,
        version="",
        config_hash=scores.config_hash,
        scheduler=scores.scheduler,
        aging_divisor_ns=scores.aging_divisor_ns,
        swap_affinity_bonus=scores.swap_affinity_bonus,
        fair_share_bonus=scores.fair_share_bonus,
        short_job_bonus=scores.short_job_bonus,
        log_format=ev.LOG_FORMAT,
    )


def _compare(
    seq: int, scores: ev.ScoresComputed, state: SchedulerState, simulated: Decision | None
) -> Divergence | None:
    if simulated is None:
        return _divergence(
            seq, scores.at, scores, state, simulated, "the simulation dispatches nothing"
        )
    if simulated.scores.request_id != scores.request_id:
        return _divergence(seq, scores.at, scores, state, simulated, "a different request wins")
    return None


def _divergence(
    seq: int,
    at: int,
    scores: ev.ScoresComputed,
    state: SchedulerState,
    simulated: Decision | None,
    detail: str,
) -> Divergence:
    sim_scores = None if simulated is None else simulated.scores
    queued = state.queue.get(scores.request_id)
    as_sim = None
    if queued is not None:
        as_sim = state.score(queued, at)
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
