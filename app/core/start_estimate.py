"""When waiting work is expected to start: the one estimator behind the live queue's
estimated starts (`/api/queue`, `gpulane queue`, explain's position), a batch's
estimated finish (app/report/progress.py) and `Retry-After`
(app/runtime/admission.py).

A pure simulation of the dispatch rule on the queue as it stands, over the
state and the learnt run times (`Durations`, app/core/run_estimate.py):

- Each running request ends its own expected run after its dispatch (the one
  learnt for it at enqueue, else its model's; once it reported progress, f
  done t after its run began, t / f), plus its model's load when it was
  dispatched into a load still going on. One that has run longer than that
  (an overrun: its run alone, from the end of its load, past its expected run)
  ends, as far as its model's last runs know, at the median of those that
  lasted longer than it has so far (`Durations.longer_than`). One that has run
  longer than every one of them (or whose model has none) has outrun what is
  known: its end is open (`Estimate.open`), known only not to be before now. No
  number is made up for it: the simulation frees its slot now, the least it
  can be, and every start behind it (after it on its slot, or after a load
  waiting for its model to drain) is a lower bound, said as such
  (`open_starts`): the work known to be left, and an unknown more.
- Each model in use has its slots (`SchedulerState.slots`), each free when the
  request on it ends (an empty one at once, or when its model's load ends).
- The waiting requests go in the queue's own dispatch order (its score, swap
  affinity for every model in use in the simulation, ties by arrival): one for
  a model in use takes that model's first free slot; one for a model not in use
  waits until every model its load evicts (`residency.to_evict`: with no
  router, every other model; in another lane, none) has drained, then pays its
  model's load, all its slots free after it. So lanes run side by side and a
  swap within a lane waits for the drain, as the run loop does.

Requests arriving later can overtake: the estimate is for the queue as it
stands (a run's finish adds their forecast: app/core/overtaking.py). A
peer's shared slots are counted per model (an estimate that may err short for
a busy peer).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Generator, Mapping
from typing import NamedTuple

from app.core.queue import Queued
from app.core.run_estimate import Durations
from app.core.state import SchedulerState

SLICE = 128
"""Requests placed between two yields of `start_steps`."""

Steps = Generator[None, None, dict[str, int]]
"""The estimate in slices: yields between them, returns request id -> start (ns)."""

_Slot = tuple[int, bool]
"""When a slot frees (ns), and whether that is only the earliest it can (it
waits for a run whose end is open)."""


class Estimate(NamedTuple):
    """When a running request is expected to end, or a waiting one to start."""

    at_ns: int
    """Unix ns; when `open`, only the earliest it can be."""
    open: bool = False
    """No later bound is known: the run (or a run it waits for) has run longer
    than every run of its model the estimate knows, or its model has none."""


def start_steps(
    state: SchedulerState,
    running_since: Mapping[str, int],
    now_ns: int,
    times: Durations,
    wanted: Collection[str] | None = None,
    arriving: Queued | None = None,
    limit: int | None = None,
    open_starts: set[str] | None = None,
) -> Steps:
    """request id -> estimated start (unix ns) of every waiting request, or of those
    placed up to the last of `wanted` (which may name `arriving`: a request not
    queued, as the queue would hold it, `SchedulerState.newcomer`), or of the first
    `limit` placed. In the order the simulation places them: the order the live
    queue lists. Yields every `SLICE` requests placed: between slices `state` must
    not change. The ids whose start is only the earliest it can be (behind a run
    whose end is open) are added to `open_starts`."""
    free = _slots_now(state, running_since, now_ns, times)
    lanes = state.queue.lanes_in_order()
    params = state.queue.params
    bonus = params.affinity_key()
    fair = state.fair_keys()  # as of now: charging later runs is beyond an estimate
    # The queue's own pick (ScoreQueue.best), following each lane lazily: the
    # affinity bonus is the same for every lane of one model, so per model a heap
    # of its lanes' next entries (each less its caller's fair-share term) orders
    # them, and each step compares one top per model, not one per lane.
    tops: dict[str, list[tuple[int, int, int, str]]] = {}
    for i, (model, caller, entries) in enumerate(lanes):
        head = next(entries, None)
        if head is not None:
            tops.setdefault(model, []).append((head[0] - fair.get(caller, 0), head[1], i, head[2]))
    if arriving is not None:
        key = params.base_key(
            arriving.priority, arriving.enqueued_ns, state.queue.expected(arriving)
        )
        entry = (-key - fair.get(arriving.caller, 0), arriving.order, -1, arriving.request_id)
        tops.setdefault(arriving.model, []).append(entry)
    for model_tops in tops.values():
        heapq.heapify(model_tops)
    left = None
    if wanted is not None:
        left = {rid for rid in wanted if rid in state.queue}
        if arriving is not None and arriving.request_id in wanted:
            left.add(arriving.request_id)
    starts: dict[str, int] = {}
    while (left is None or left) and (limit is None or len(starts) < limit):
        best: tuple[int, int, str] | None = None
        for model, model_tops in tops.items():
            if model_tops:
                key = model_tops[0][0] - (bonus if model in free else 0)
                if best is None or (key, model_tops[0][1]) < best[:2]:
                    best = (key, model_tops[0][1], model)
        if best is None:
            break
        model = best[2]
        _, _, i, request_id = tops[model][0]
        if i < 0:
            heapq.heappop(tops[model])
            expected = arriving.expected_run_ns if arriving is not None else None
        else:
            _, caller, entries = lanes[i]
            head = next(entries, None)
            if head is None:
                heapq.heappop(tops[model])
            else:
                entry = (head[0] - fair.get(caller, 0), head[1], i, head[2])
                heapq.heapreplace(tops[model], entry)
            expected = state.requests[request_id].expected_run_ns
        slots = free.get(model)
        if slots is None:
            slots = free[model] = _load(state, free, model, now_ns, times)
        t, behind_open = heapq.heappop(slots)
        starts[request_id] = t
        if behind_open and open_starts is not None:
            open_starts.add(request_id)
        heapq.heappush(slots, (t + times.of(model, expected), behind_open))
        if left is not None:
            left.discard(request_id)
        if len(starts) % SLICE == 0:
            yield
    return starts


def estimate_starts(
    state: SchedulerState,
    running_since: Mapping[str, int],
    now_ns: int,
    times: Durations,
    wanted: Collection[str] | None = None,
) -> dict[str, int]:
    """`start_steps` at once."""
    return finish(start_steps(state, running_since, now_ns, times, wanted))


def start_of(
    state: SchedulerState,
    arriving: Queued,
    running_since: Mapping[str, int],
    now_ns: int,
    times: Durations,
) -> Estimate:
    """When `arriving` (not queued) would start if nothing else came (unix ns;
    `open`: the earliest it can, behind a run whose end is open)."""
    behind: set[str] = set()
    steps = start_steps(
        state, running_since, now_ns, times, (arriving.request_id,), arriving, open_starts=behind
    )
    return Estimate(finish(steps)[arriving.request_id], arriving.request_id in behind)


def end_of(
    state: SchedulerState,
    request_id: str,
    running_since: Mapping[str, int],
    now_ns: int,
    times: Durations,
) -> Estimate:
    """When a running request is expected to end, as the estimate counts it: its
    expected run after its load, or, once it reported progress (fraction f done
    t after its run began, `request_progressed`), t / f after that start; for
    an overrun, the median of its model's last runs that lasted longer than it
    has so far; past all of them, open (not before now, no end known). Never
    before now."""
    request = state.requests[request_id]
    model = state.running.get(request_id, request.model)
    expected = times.of(model, request.expected_run_ns)
    load = times.load(model) if model in state.loads else 0
    run_from = running_since.get(request_id, now_ns) + load
    if request.progress is not None:
        done, total, at_ns = request.progress
        if 0 < done <= total and at_ns > run_from:
            # What the job itself says beats what its model's past runs say.
            # (The run's start is its dispatch: a load it waited for errs long.)
            expected = (at_ns - run_from) * total // done
    if run_from + expected > now_ns:
        return Estimate(run_from + expected)
    longer = times.longer_than(model, now_ns - run_from)
    if longer:
        return Estimate(run_from + longer[(len(longer) - 1) // 2])
    return Estimate(now_ns, open=True)


def finish(steps: Steps) -> dict[str, int]:
    """Run `steps` to the end, at once."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: dict[str, int] = done.value
            return result


def _slots_now(
    state: SchedulerState, running_since: Mapping[str, int], now_ns: int, times: Durations
) -> dict[str, list[_Slot]]:
    """Per model in use (or with running work): when each of its slots frees, a heap."""
    ends: dict[str, list[_Slot]] = {model: [] for model in state.in_use}
    load_ends: dict[str, int] = {}  # a model being loaded: when its load ends
    for model in state.loads:
        load_ends[model] = now_ns + times.load(model)  # not known when it began: errs long
    for request_id, model in state.running.items():
        end = end_of(state, request_id, running_since, now_ns, times)
        ends.setdefault(model, []).append((end.at_ns, end.open))
        if model in state.loads:
            since = running_since.get(request_id, now_ns) + times.load(model)
            load_ends[model] = max(now_ns, min(load_ends[model], since))
    free: dict[str, list[_Slot]] = {}
    for model, model_ends in ends.items():
        width = max(1, state.slots(model))
        # An empty slot frees now, or when its model's load ends; more running
        # than slots free as the last ones end.
        model_ends.sort()
        slots = model_ends[-width:]
        slots[:0] = [(load_ends.get(model, now_ns), False)] * (width - len(slots))
        heapq.heapify(slots)
        free[model] = slots
    return free


def evicted_by(state: SchedulerState, model: str, in_use: Collection[str]) -> frozenset[str]:
    """The models of `in_use` that loading `model` stops (`residency.to_evict`)."""
    try:
        return state.to_evict(model, frozenset(in_use))
    except ValueError:  # no group (a choice between peers): it evicts nothing
        return frozenset()


def _load(
    state: SchedulerState, free: dict[str, list[_Slot]], model: str, now_ns: int, times: Durations
) -> list[_Slot]:
    """`model` loads once every model its load evicts has drained (they leave the
    simulation): its slots, all free when the load ends (at the earliest, if a
    run it waits for has an open end)."""
    start, behind_open = now_ns, False
    for other in evicted_by(state, model, free):
        for t, is_open in free.pop(other):
            start = max(start, t)
            behind_open = behind_open or is_open
    return [(start + times.load(model), behind_open)] * max(1, state.slots(model))
