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
from app.core.peers import candidates
from app.core.queue import FairKeys, Pick, Queued
from app.core.state import FIFO, SchedulerState

Action = Literal["swap", "join", "run"]
"""swap: load the winner's model first (the models `Choice.evicted` names are stopped);
join: its model is being loaded, it runs when that load ends;
run: its model is resident, it runs now."""


class Choice(msgspec.Struct, frozen=True, kw_only=True):
    """The next dispatch and what it means, without the scores that explain it."""

    pick: Pick
    """The winner and the winners without each term (each is the winner while
    its term is off)."""
    dispatched: ev.RequestDispatched
    action: Action
    evicted: frozenset[str] = frozenset()
    """With `swap`: the models its load evicts (`residency.to_evict`), all idle."""


class Decision(Choice, frozen=True, kw_only=True):
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
        evicted=choice.evicted,
        # The same state as the pick's: the same fair-share terms.
        scores=_scores_event(state, choice.pick, now_ns, state.fair_keys()),
    )


def choose(state: SchedulerState, now_ns: int) -> Choice | None:
    """`decide` without its `scores_computed`, for a run that records nothing (the
    replay's what-if runs): the same dispatch, at the cost of the pick alone."""
    found = _dispatch_pick(state, now_ns)
    if found is None:
        return None
    pick, evicted, target = found
    winner = pick.winner
    dispatched = ev.RequestDispatched(
        at=now_ns,
        request_id=winner.request_id,
        # A choice's request names the peer it goes to (`app.core.peers`).
        model=target,
        attempt=state.requests[winner.request_id].attempt,
        swap=target not in state.in_use,
        choice=winner.model if target != winner.model else None,
    )
    if dispatched.swap:
        action: Action = "swap"
    elif dispatched.model in state.loads:
        action = "join"
    else:
        action = "run"
    return Choice(pick=pick, dispatched=dispatched, action=action, evicted=evicted)


def _pick(state: SchedulerState, skip: frozenset[str], fair: FairKeys) -> Pick | None:
    if state.scheduler != FIFO:
        return state.queue.pick(state.affine, fair, skip)
    # fifo: the queue's order alone (model priority + header, then arrival).
    winner = state.queue.best(None, skip=skip)
    if winner is None:
        return None
    return Pick(
        winner=winner,
        runner_up=None,
        without_aging=winner,
        without_affinity=winner,
        without_fair_share=winner,
        without_short_job=winner,
    )


def _dispatch_pick(state: SchedulerState, now_ns: int) -> tuple[Pick, frozenset[str], str] | None:
    """The dispatch rule, for both schedulers: the best-scoring waiting request
    that can start now, the models its start evicts and the model it runs on (its
    own; for a choice, one of its peers'). Whether a request can
    start depends only on its model, so the rule walks the models in the order
    of their best waiting request and takes the first that can start:

    - a model in use (resident, or loading) starts one more request while it has
      a free slot (`SchedulerState.slots`); serial does not join a load no
      request waits on (a preload), fifo does;
    - a model not in use starts by a load, when every model the router says the
      load evicts (`residency.to_evict`) is idle: nothing running on it, not
      loading;
    - a model that cannot start holds the ones below it back: its own model
      takes no more work (full, or waited on), and when it waits for evictions,
      the models it would evict take no new work (they drain) and no lower
      request may evict them or load a model its load would have to evict. So
      the swap happens as soon as the in-flight work on them ends
      (non-preemptive; slots cannot starve a swap).

    A model backing off after failed loads (`SchedulerState.backing_off`) is left
    out before all of this: its requests wait, they hold nothing back, and the
    other models' requests are served as if they were not there.

    With no router and one slot per model this is the one-at-a-time rule of
    before: the best request starts when nothing runs or loads, else nothing.
    The recorded counterfactuals (`Pick`) are among the requests of the models
    not held back before the winner's."""
    backing_off = state.backing_off(now_ns)
    fair = state.fair_keys()  # the same for every question below: the state does not move
    pick = _pick(state, backing_off, fair)
    if pick is None:
        return None
    held: set[str] = set()
    """Models that may take no new work and may not be evicted by a lower request."""
    awaited: list[str] = []
    """Targets of higher requests that wait for evictions."""
    start = _start(state, pick.winner.model, held, awaited, backing_off)
    if start is not None:
        return pick, *start
    skip = {pick.winner.model, *backing_off}
    for model in state.queue.model_order(state.affine, fair):
        if model in skip:
            continue
        if model in held and model not in state.choices:
            skip.add(model)  # held back: `_can_start` would say no at once
            continue
        start = _start(state, model, held, awaited, backing_off)
        if start is not None:
            found = _pick(state, frozenset(skip), fair)
            assert found is not None and found.winner.model == model
            return found, *start
        skip.add(model)
    return None


def _start(
    state: SchedulerState,
    model: str,
    held: set[str],
    awaited: list[str],
    blocked: frozenset[str],
) -> tuple[frozenset[str], str] | None:
    """`_can_start` and the model a request for `model` runs on: itself, or for
    a choice the first of its peers' entries that can start (reachable ones
    first, `peers.candidates`)."""
    choices = state.choices.get(model)
    if choices is None:
        evicted = _can_start(state, model, held, awaited)
        return None if evicted is None else (evicted, model)
    options = candidates(choices, state.last_target.get(model), state.load_failures.keys(), blocked)
    for target in sorted(options, key=lambda m: m not in state.in_use):
        evicted = _can_start(state, target, held, awaited)
        if evicted is not None:
            return evicted, target
    return None


def _can_start(
    state: SchedulerState, model: str, held: set[str], awaited: list[str]
) -> frozenset[str] | None:
    """What starting a request for `model` now evicts, or None when it cannot
    start (then `held` and `awaited` grow with what it holds back)."""
    if not state.running and not state.loads and not held:
        # Nothing runs or loads (the usual moment of a one-lane decision): every
        # model is idle, so anything can start.
        in_use = state.in_use
        return _NOTHING if model in in_use else state.to_evict(model, in_use)
    if model in held:
        return None
    if model in state.peer_of and not state.has_free_slot(model):
        held.add(model)  # its peer's slots are taken, by this model or another
        return None
    if state.lane_taken(model):
        # One lane (the memory router's default): it waits until no other model
        # runs or loads, and what runs drains (takes no new work) until then.
        held.update(state.running.values(), state.loads)
        held.add(model)
        if model not in state.in_use:
            held.update(state.to_evict(model, state.occupied()))
            awaited.append(model)
        return None
    if model in state.in_use:
        # A load no request waits on (a preload, or one whose request left) is
        # not joined under serial: requests wait for it to end, then take the
        # slots in score order.
        joinable = model not in state.loads or state.scheduler == FIFO or state.running_on(model)
        if joinable and state.has_free_slot(model):
            return _NOTHING
        held.add(model)
        return None
    if state.running_on(model):
        held.add(model)  # its process is gone under running work: that work ends first
        return None
    occupied = state.occupied()
    evict = state.to_evict(model, occupied)
    if not evict.isdisjoint(held) or state.any_busy(evict):
        held.update(evict)
        held.add(model)
        awaited.append(model)
        return None
    if awaited:
        after = (occupied - evict) | {model}
        for target in awaited:
            if model in state.to_evict(target, after):
                held.add(model)  # a higher request's load would have to evict it
                return None
    return evict


_NOTHING: frozenset[str] = frozenset()


def cannot_start(state: SchedulerState, model: str) -> bool:
    """Whether a request for `model` cannot start now whatever waits above it, as
    `_can_start` would find whatever it holds back: its model is in use with
    every slot taken, or it has running work without its process, or loading it
    would evict a busy model (each needs something running or loading, so the
    "nothing runs" shortcut never applies). False where unsure: peers, choices,
    failed loads (their back-off ends with time alone).

    For a caller that skips futile decisions (the replay's several-lane loop): the
    dispatch rule only holds back more when more is held above a model, so after
    a decision that found nothing to start, an arrival for such a model, which
    moves only its own model up the order, leaves nothing to start, as long as no
    other score moved (no caller became active under fair share, no short-job
    estimate changed) and nothing else happened (no run or load ended, no
    request left)."""
    if state.peer_of or state.choices or state.load_failures:
        return False
    if state.lane_taken(model):
        return True
    if model in state.in_use:
        return not state.has_free_slot(model)
    if state.running_on(model):
        return True
    return state.any_busy(state.to_evict(model, state.occupied()))


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


def given_up(state: SchedulerState, model: str) -> list[str]:
    """The waiting requests of `model` to fail now, in arrival order: its loads
    have failed `loadFailureLimit` times in a row (none while the limit is 0 or
    not reached). The run loop asks after each `swap_failed` and fails them with
    the loader's error."""
    failures = state.load_failures.get(model)
    limit = state.load_backoff.failure_limit
    if failures is None or limit <= 0 or failures.count < limit:
        return []
    return [r.request_id for r in state.requests.values() if r.model == model and not r.running]


def next_resident(state: SchedulerState) -> str | None:
    """The model loaded at the next decision: the one loading now, else the resident
    one (with several lanes, the last of each; `SchedulerState.in_use` has them all)."""
    return state.loading or state.resident


def ahead_of(state: SchedulerState, request_id: str) -> int | None:
    """How many waiting requests the next decision ranks before this one (0: it
    goes next); None when it is not waiting. O(n): not for the request path. Not
    what readers call a position: that is the live queue's order, the dispatch
    rule played forward (`start_estimate.start_steps`, app/runtime/places.py)."""
    return state.queue.position(request_id, state.affine, state.fair_keys())
