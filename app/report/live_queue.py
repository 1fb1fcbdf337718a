"""The live queue (`GET /api/queue`, `gpulane queue`): who waits, in what order, until when.

Computed from `SchedulerState` with the core's own scoring, so the positions
and scores are the ones the next decision will use. Pure: the caller passes
the state, the dispatch times of what is running, `now` and the measured run
times. `explain` uses the same functions on a replayed state.

The queue is followed in place, lane by lane (`ScoreQueue.lanes_in_order`), so a
window of the first rows costs O(k log k); `queue_view_steps` computes a view in
slices, for a caller that does other work between them (app/web/live_queue_view.py).

Estimated starts simulate the serial policy on the queue as it stands: each
running job ends after its model's median run time (counted from its
dispatch, plus a median load if its model is still loading), and the waiting
requests go in the queue's own dispatch order: one for the model in use takes
its first free slot (a model has `SchedulerState.slots`, one unless its
`concurrencyLimit` says more), one for another model waits until every slot
has drained, then pays a median load. Requests arriving later can overtake;
the estimate is for the queue as it stands.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Generator, Iterator, Mapping, Sequence
from typing import TypeVar, cast

import msgspec

from app.core.policy import ahead_of, next_resident
from app.core.priority import band_of
from app.core.queue import Affine, FairKeys, Queued
from app.core.scoring import NS_PER_S, Breakdown
from app.core.state import SchedulerState
from app.report.run_times import RunTimes
from app.report.waits import WaitsFor, waits_for

SLICE = 128
"""Rows of work between two yields of `queue_view_steps` (~1 ms at most)."""

T = TypeVar("T")
Steps = Generator[None, None, T]
"""A computation in slices: yields between them, returns its result."""


class WaitingEntry(msgspec.Struct, frozen=True):
    position: int
    """1 = dispatched next if nothing else arrives."""
    request_id: str
    model: str
    priority: int
    band: str
    score: Breakdown
    """Its score as of now (the next decision adds the resident model's bonus the same way)."""
    enqueued_at: float
    waited_s: float
    estimated_start_at: float
    """Unix seconds when it is expected to start running (after its own swap, if any)."""
    estimated_start_in_s: float
    caller: str | None = None
    """The caller's label (API key label or X-Gpulane-Caller); None: anonymous."""
    waits_for: WaitsFor | None = None
    """What it waits for: a free slot of its model, a model to drain, a load
    (app/report/waits.py)."""


class RunningEntry(msgspec.Struct, frozen=True):
    request_id: str
    model: str
    priority: int
    band: str
    since: float | None
    """Unix seconds when it was dispatched (None when not known)."""
    for_s: float | None
    loading: bool
    """Its model is still being loaded."""
    caller: str | None = None


class QueueView(msgspec.Struct, frozen=True):
    as_of: float
    scheduler: str
    resident: str | None
    loading: str | None
    aging_divisor_s: float
    swap_affinity_bonus: int
    running: list[RunningEntry]
    waiting: list[WaitingEntry]
    fair_share_bonus: int = 0
    short_job_bonus: int = 0
    total_waiting: int = 0
    """Everyone waiting; `waiting` may list only a window of them."""
    waiting_by_model: dict[str, int] = {}


def estimate_starts(
    state: SchedulerState,
    running_since: Mapping[str, int],
    now_ns: int,
    times: RunTimes,
    wanted: Collection[str] | None = None,
) -> dict[str, int]:
    """request id -> estimated start (unix ns) for every waiting request, or for
    those dispatched up to the last of `wanted`: the queue is followed in dispatch
    order (the resident model changing as it would), each request taking its
    model's median run and a swap its median load."""
    return _finish(_estimate_steps(state, running_since, now_ns, times, wanted))


def _estimate_steps(
    state: SchedulerState,
    running_since: Mapping[str, int],
    now_ns: int,
    times: RunTimes,
    wanted: Collection[str] | None,
) -> Steps[dict[str, int]]:
    resident = next_resident(state)
    ends: list[int] = []  # when each running request of the model in use ends
    others = now_ns  # when the running work on any other model ends
    for request_id, model in state.running.items():
        expected = times.run(model) + (times.swap(model) if state.loading == model else 0.0)
        elapsed = (now_ns - running_since.get(request_id, now_ns)) / NS_PER_S
        end = now_ns + _ns(max(0.0, expected - elapsed))
        if model == resident:
            ends.append(end)
        else:
            others = max(others, end)
    # When each slot of the model in use frees (a heap): its running requests'
    # ends, the rest free now; more running than slots free as the last ones end.
    width = 1 if resident is None else state.slots(resident)
    ends.sort()
    free = [max(end, others) for end in ends[-width:]]
    free[:0] = [others] * (width - len(free))
    lanes = state.queue.lanes_in_order()
    bonus = state.queue.params.affinity_key()
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
    for model_tops in tops.values():
        heapq.heapify(model_tops)
    left = None if wanted is None else {rid for rid in wanted if rid in state.queue}
    starts: dict[str, int] = {}
    while left is None or left:
        best: tuple[int, int, str] | None = None
        for model, model_tops in tops.items():
            if model_tops:
                key = model_tops[0][0] - (bonus if model == resident else 0)
                if best is None or (key, model_tops[0][1]) < best[:2]:
                    best = (key, model_tops[0][1], model)
        if best is None:
            break
        model = best[2]
        _, _, i, request_id = tops[model][0]
        _, caller, entries = lanes[i]
        head = next(entries, None)
        if head is None:
            heapq.heappop(tops[model])
        else:
            heapq.heapreplace(tops[model], (head[0] - fair.get(caller, 0), head[1], i, head[2]))
        if model != resident:
            # the model in use drains, then this one loads, all its slots free
            free = [max(free) + _ns(times.swap(model))] * state.slots(model)
            resident = model
        t = heapq.heappop(free)
        starts[request_id] = t
        heapq.heappush(free, t + _ns(times.run(model)))
        if left is not None:
            left.discard(request_id)
        if len(starts) % SLICE == 0:
            yield
    return starts


def position_of(
    state: SchedulerState,
    running_since: Mapping[str, int],
    now_ns: int,
    times: RunTimes,
    request_id: str,
) -> tuple[int, int, int] | None:
    """(position from 1, queue depth, estimated start ns) of a waiting request, else None."""
    ahead = ahead_of(state, request_id)
    if ahead is None:
        return None
    start = estimate_starts(state, running_since, now_ns, times, (request_id,))[request_id]
    return ahead + 1, len(state.queue), start


def queue_view(
    state: SchedulerState,
    running_since: Mapping[str, int],
    now_ns: int,
    times: RunTimes,
    *,
    first: int = 0,
    count: int | None = None,
    caller: str | None = None,
) -> QueueView:
    """The live queue; with `count`, only positions `first`..`first + count - 1`
    (0-based) are listed, for O(k log k) work (the lanes are followed lazily, see
    `ScoreQueue.lanes_in_order`), not O(n). With `caller` (a user key's page),
    only its requests and the one just ahead of each (for its reason) are
    listed, at their places in the whole queue (as far down as its last row)."""
    steps = queue_view_steps(
        state, running_since, now_ns, times, first=first, count=count, caller=caller
    )
    return _finish(steps)


def queue_view_steps(
    state: SchedulerState,
    running_since: Mapping[str, int],
    now_ns: int,
    times: RunTimes,
    *,
    first: int = 0,
    count: int | None = None,
    caller: str | None = None,
) -> Steps[QueueView]:
    """`queue_view` in slices: a generator that yields after every `SLICE` rows of
    work and returns the view. Between slices the caller may do other work (the
    run loop's), as long as `state` does not change meanwhile: pass a
    `SchedulerState.snapshot()` and a copy of `running_since`."""
    resident = next_resident(state)
    fair = state.fair_keys()
    listed: Sequence[int]
    wanted: list[str] | None
    in_order = _in_dispatch_order(state, resident, fair)
    ranked: list[Queued] = []
    if count is not None:
        for q in itertools.islice(in_order, first + count):
            ranked.append(q)
            if len(ranked) % SLICE == 0:
                yield
        listed = range(first, len(ranked))
        wanted = [ranked[i].request_id for i in listed]
    elif caller is not None:
        # Only as far down the queue as its last row: its rows' positions.
        left = sum(1 for q in state.queue if q.caller == caller)
        for q in in_order if left else ():
            ranked.append(q)
            if q.caller == caller:
                left -= 1
                if not left:
                    break
            if len(ranked) % SLICE == 0:
                yield
        mine = [i for i, q in enumerate(ranked) if q.caller == caller]
        listed = sorted({j for i in mine for j in (i - 1, i) if j >= first})
        wanted = [ranked[i].request_id for i in listed]
    else:
        for q in in_order:
            ranked.append(q)
            if len(ranked) % SLICE == 0:
                yield
        listed = range(first, len(ranked))
        wanted = None
    starts = yield from _estimate_steps(state, running_since, now_ns, times, wanted)
    by_model = state.queue.waiting_by_model()
    blocked: dict[str, WaitsFor] = {}  # depends on the model alone
    waiting = []
    for index in listed:
        item = ranked[index]
        position = index + 1
        request = state.requests[item.request_id]
        header_priority = request.priority
        start = starts[item.request_id]
        waiting.append(
            WaitingEntry(
                position=position,
                request_id=item.request_id,
                model=item.model,
                priority=header_priority,
                band=band_of(header_priority),
                score=state.score(item, now_ns, fair),
                enqueued_at=item.enqueued_ns / NS_PER_S,
                waited_s=(now_ns - item.enqueued_ns) / NS_PER_S,
                estimated_start_at=start / NS_PER_S,
                estimated_start_in_s=(start - now_ns) / NS_PER_S,
                caller=request.caller,
                waits_for=blocked.get(item.model)
                or blocked.setdefault(item.model, waits_for(state, item.model)),
            )
        )
        if len(waiting) % SLICE == 0:
            yield
    running = []
    for request_id, model in sorted(
        state.running.items(), key=lambda kv: running_since.get(kv[0], now_ns)
    ):
        request = state.requests[request_id]
        since = running_since.get(request_id)
        running.append(
            RunningEntry(
                request_id=request_id,
                model=model,
                priority=request.priority,
                band=band_of(request.priority),
                since=None if since is None else since / NS_PER_S,
                for_s=None if since is None else (now_ns - since) / NS_PER_S,
                loading=state.loading == model,
                caller=request.caller,
            )
        )
    return QueueView(
        as_of=now_ns / NS_PER_S,
        scheduler=state.scheduler,
        resident=state.resident,
        loading=state.loading,
        aging_divisor_s=state.params.aging_divisor_ns / NS_PER_S,
        swap_affinity_bonus=state.params.swap_affinity_bonus,
        running=running,
        waiting=waiting,
        fair_share_bonus=state.params.fair_share_bonus,
        short_job_bonus=state.params.short_job_bonus,
        total_waiting=len(state.queue),
        waiting_by_model=by_model,
    )


def _finish(steps: Steps[T]) -> T:
    """Run `steps` to the end, at once."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return cast(T, done.value)


def _in_dispatch_order(state: SchedulerState, resident: Affine, fair: FairKeys) -> Iterator[Queued]:
    """The waiting requests in dispatch order as of now (`ScoreQueue.ranked` with
    the same `resident`: one model or the set that gets the affinity bonus),
    lazily: a merge of the lanes' own orders, so the first k cost O(k log k +
    lanes), not a sort of the whole queue."""
    bonus = state.queue.params.affinity_key()
    affine = {resident} if resident is None or isinstance(resident, str) else resident
    lanes = state.queue.lanes_in_order()
    heads: list[tuple[int, int, int, str]] = []
    adjust = [fair.get(caller, 0) + (bonus if model in affine else 0) for model, caller, _ in lanes]
    for i, (_, _, entries) in enumerate(lanes):
        head = next(entries, None)
        if head is not None:
            heads.append((head[0] - adjust[i], head[1], i, head[2]))
    heapq.heapify(heads)
    get = state.queue.get
    while heads:
        _, _, i, request_id = heads[0]
        head = next(lanes[i][2], None)
        if head is None:
            heapq.heappop(heads)
        else:
            heapq.heapreplace(heads, (head[0] - adjust[i], head[1], i, head[2]))
        item = get(request_id)
        assert item is not None  # the walk yields live entries only
        yield item


def _ns(seconds: float) -> int:
    return int(seconds * NS_PER_S)
