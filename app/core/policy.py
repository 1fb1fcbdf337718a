"""Scheduling decisions: pure functions from state and `now` to events.

`decide` returns at most one dispatch: its events and what it means; the caller
applies the events (`state.apply`), acts, and calls again until it returns
None, so several fifo dispatches in one moment see each other's effect exactly
as replay does. The live run loop, the simulator and the tests act on the same
`Decision.action`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from app.core import events as ev
from app.core.queue import FairKeys, Pick, Queued
from app.core.state import FIFO, SchedulerState

Action = Literal["swap", "join", "run"]
"""swap: load the winner's model first (every other model is stopped);
join: its model is being loaded, it runs when that load ends;
run: its model is resident, it runs now."""


class Choice(msgspec.Struct, frozen=True):
    """The next dispatch and what it means, without the scores that explain it."""

    pick: Pick
    """The winner and the winners without each term (each is the winner while
    its term is off)."""
    dispatched: ev.RequestDispatched
    action: Action


class Decision(Choice, frozen=True):
    """A `Choice` with its `scores_computed`: what the live server records."""

    scores: ev.ScoresComputed

    @property
    def events(self) -> list[ev.AnyEvent]:
        """What to record and apply, in this order."""
        return [self.scores, self.dispatched]


def decide(state: SchedulerState, now_ns: int) -> Decision | None:
    """The next dispatch, or None when nothing can be dispatched now."""
    choice = choose(state, now_ns)
    if choice is None:
        return None
    return Decision(
        pick=choice.pick,
        dispatched=choice.dispatched,
        action=choice.action,
        # The same state as the pick's: the same fair-share terms.
        scores=_scores_event(state, choice.pick, now_ns, state.fair_keys()),
    )


def choose(state: SchedulerState, now_ns: int) -> Choice | None:
    """`decide` without its `scores_computed`, for a run that records nothing (the
    replay's what-if runs): the same dispatch, at the cost of the pick alone."""
    if state.scheduler == FIFO:
        winner = _fifo_choice(state)
        if winner is None:
            return None
        pick = Pick(
            winner=winner,
            runner_up=None,
            without_aging=winner,
            without_affinity=winner,
            without_fair_share=winner,
            without_short_job=winner,
        )
    else:
        found = _serial_pick(state)
        if found is None:
            return None
        pick = found
    winner = pick.winner
    target = state.loading or state.resident
    dispatched = ev.RequestDispatched(
        at=now_ns,
        request_id=winner.request_id,
        model=winner.model,
        attempt=state.requests[winner.request_id].attempt,
        swap=winner.model != target,
    )
    if dispatched.swap:
        action: Action = "swap"
    elif state.loading == dispatched.model:
        action = "join"
    else:
        action = "run"
    return Choice(pick=pick, dispatched=dispatched, action=action)


def _serial_pick(state: SchedulerState) -> Pick | None:
    """The dispatch rule with one model resident at a time, non-preemptive: the
    best-scoring waiting request starts when the lane is idle (loading its model
    if it is not resident), or when its model is the one in use (resident, or
    being loaded for a request) and has a free slot (`SchedulerState.slots`).
    Otherwise nothing starts: every other waiting request scores lower and wants
    either that same full model or another one, which needs the model in use
    evicted; so the lane drains and the best one swaps in as soon as the
    in-flight work ends (slots cannot starve a swap). With one slot per model
    this is one request in flight across all models, as before format 4."""
    if not state.running and state.loading is None:
        return state.queue.pick(state.resident, state.fair_keys())
    target = state.loading or state.resident
    # A load no request waits on (a preload, or one whose request left) is not
    # joined: requests wait for it to end, then take the slots in score order.
    if target is None:
        return None
    slots = state.slots(target)
    if slots == 1 or not 0 < state.running_on(target) < slots:
        return None
    found = state.queue.pick(target, state.fair_keys())
    if found is None or found.winner.model != target:
        return None  # another model is wanted: the lane drains for it
    return found


def _fifo_choice(state: SchedulerState) -> Queued | None:
    """llama-swap's fifo: the head of the queue (model priority + header, then
    arrival) runs on its model when ready, up to its concurrency limit; a head
    for another model waits until nothing is in flight, then swaps. Requests
    for a model being loaded join that load."""
    head = state.queue.best(None)
    if head is None:
        return None
    target = state.loading or state.resident
    if head.model == target:
        return head if state.running_on(head.model) < state.slots(head.model) else None
    if not state.running and state.loading is None:
        return head
    return None


def _scores_event(
    state: SchedulerState, pick: Pick, now_ns: int, fair: FairKeys
) -> ev.ScoresComputed:
    params = state.queue.params
    winner = pick.winner

    def breakdown(q: Queued) -> ev.Breakdown:
        return state.score(q, now_ns, fair)

    runner = pick.runner_up
    return ev.ScoresComputed(
        at=now_ns,
        request_id=winner.request_id,
        queue_depth=len(state.queue),
        resident=state.resident,
        winner=breakdown(winner),
        runner_up_id=None if runner is None else runner.request_id,
        runner_up=None if runner is None else breakdown(runner),
        without_aging_id=pick.without_aging.request_id,
        without_affinity_id=pick.without_affinity.request_id,
        # None while a term is off (its counterfactual is the winner), so
        # logs from before these terms existed read as this code decides.
        without_fair_share_id=(
            pick.without_fair_share.request_id if params.fair_share_bonus else None
        ),
        without_short_job_id=(
            pick.without_short_job.request_id if params.short_job_bonus else None
        ),
        aging_divisor_ns=params.aging_divisor_ns,
        swap_affinity_bonus=params.swap_affinity_bonus,
        fair_share_bonus=params.fair_share_bonus,
        short_job_bonus=params.short_job_bonus,
        scheduler=state.scheduler,
        config_hash=state.config_hash,
    )


REORDER_REASONS = ("aging", "swap_affinity", "fair_share", "short_job")


def reorder_reasons(scores: ev.ScoresComputed) -> list[str]:
    """Which terms changed this pick (in `REORDER_REASONS` order): the winner
    without that term would have been another request."""
    without = (
        scores.without_aging_id,
        scores.without_affinity_id,
        scores.without_fair_share_id,
        scores.without_short_job_id,
    )
    return _changed(scores.request_id, without)


def pick_reasons(pick: Pick) -> list[str]:
    """`reorder_reasons` of a pick that was not recorded (a `Choice`)."""
    without = (
        pick.without_aging.request_id,
        pick.without_affinity.request_id,
        pick.without_fair_share.request_id,
        pick.without_short_job.request_id,
    )
    return _changed(pick.winner.request_id, without)


def _changed(winner: str, without: tuple[str | None, ...]) -> list[str]:
    return [
        reason
        for reason, other in zip(REORDER_REASONS, without, strict=True)
        if other is not None and other != winner
    ]


def next_resident(state: SchedulerState) -> str | None:
    """The model loaded at the next decision: the one loading now, else the resident one."""
    return state.loading or state.resident


def ahead_of(state: SchedulerState, request_id: str) -> int | None:
    """How many waiting requests would be dispatched before this one if nothing
    else arrived (0: it goes next); None when it is not waiting. The one answer
    to "where am I in the queue" for every reader (`/v1/jobs`, `/api/queue`,
    `gpulane queue`, the loading-state chunks): ranked against the model that
    will be resident at the next decision."""
    return state.queue.position(request_id, next_resident(state), state.fair_keys())
