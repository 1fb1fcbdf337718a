"""The live queue (`GET /api/queue`, `gpulane queue`): who waits, in what order, until when.

Computed from `SchedulerState` with the core's own scoring, so the scores are
the ones the next decision will use. The waiting requests are listed in one
order, the one the estimated starts simulate (`start_estimate.start_steps`: the
dispatch rule played forward, each model getting the affinity bonus once the
simulation has it in use), so no row starts before the row above it; the first
row is the next decision's pick. Pure: the caller passes
the state, the dispatch times of what is running, `now` and the measured run
times. `explain` uses the same functions on a replayed state.

The queue is followed in place, lane by lane (`ScoreQueue.lanes_in_order`), so a
window of the first rows costs O(k log k); `queue_view_steps` computes a view in
slices, for a caller that does other work between them (app/web/live_queue_view.py).

Estimated starts are the one estimator's (app/core/start_estimate.py, shared with
`Retry-After` and a batch's ETA): the dispatch rule simulated on the queue as it
stands, each request taking its own learnt run time (else its model's), a model
its slots, a load waiting for what it evicts to drain (lanes side by side).
A run that has outlived every run of its model has an open end
(`expected_end_open`), and a start behind it is only the earliest it can be
(`estimated_start_open`): the work known to be left, never a made-up number.
`times` is each model's run and load times: the live server's learnt ones
(`Scheduler.durations`), or medians read from the log (`RunTimes`, for explain).
Requests arriving later can overtake; the estimate is for the queue as it stands.
"""

from __future__ import annotations

from collections.abc import Collection, Generator, Mapping, Sequence
from typing import TypeVar, cast

import msgspec

from app.core import start_estimate
from app.core.priority import band_of
from app.core.run_estimate import Durations
from app.core.scoring import NS_PER_S, Breakdown
from app.core.start_estimate import end_of, start_steps
from app.core.state import SchedulerState
from app.core.wait import wait_ns
from app.report.run_times import RunTimes
from app.report.waits import WaitsFor, waits_for

SLICE = 128
"""Rows of work between two yields of `queue_view_steps` (~1 ms at most)."""

T = TypeVar("T")
Steps = Generator[None, None, T]
"""A computation in slices: yields between them, returns its result."""

Times = RunTimes | Durations
"""Each model's run and load times (see the module's docstring)."""


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
    estimated_start_open: bool = False
    """Its estimated start is only the earliest it can be: it waits behind a run
    that has run longer than any run of its model (`RunningEntry.expected_end_open`)."""


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
    expected_end_at: float | None = None
    """Unix seconds when it is expected to end (`start_estimate.end_of`); when
    `expected_end_open`, only the earliest it can (now)."""
    expected_end_open: bool = False
    """It has run longer than every run of its model known (or its model has
    none): its end is not known."""
    progress: tuple[int, int] | None = None
    """(done, total) as the job last reported it (`request_progressed`: a
    render's steps), which its expected end follows; None when it reported none."""


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
    times: Times,
    wanted: Collection[str] | None = None,
    open_starts: set[str] | None = None,
) -> dict[str, int]:
    """request id -> estimated start (unix ns) for every waiting request, or for
    those dispatched up to the last of `wanted` (`start_estimate.start_steps`;
    those only at the earliest go to `open_starts`)."""
    steps = start_estimate.start_steps(
        state, running_since, now_ns, durations(times), wanted, open_starts=open_starts
    )
    return start_estimate.finish(steps)


def durations(times: Times) -> Durations:
    """`times` in the estimator's terms."""
    return times if isinstance(times, Durations) else times.durations()


def position_of(
    state: SchedulerState,
    running_since: Mapping[str, int],
    now_ns: int,
    times: Times,
    request_id: str,
) -> tuple[int, int, int, bool] | None:
    """(position from 1, queue depth, estimated start ns, whether that start is
    only the earliest it can be) of a waiting request, else None."""
    if request_id not in state.queue:
        return None
    # Its place in the simulation (the live queue's order): the last one placed.
    behind_open: set[str] = set()
    starts = estimate_starts(state, running_since, now_ns, times, (request_id,), behind_open)
    return len(starts), len(state.queue), starts[request_id], request_id in behind_open


def queue_view(
    state: SchedulerState,
    running_since: Mapping[str, int],
    now_ns: int,
    times: Times,
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
    times: Times,
    *,
    first: int = 0,
    count: int | None = None,
    caller: str | None = None,
) -> Steps[QueueView]:
    """`queue_view` in slices: a generator that yields after every `SLICE` rows of
    work and returns the view. Between slices the caller may do other work (the
    run loop's), as long as `state` does not change meanwhile: pass a
    `SchedulerState.snapshot()` and a copy of `running_since`."""
    fair = state.fair_keys()
    expected = durations(times)
    # One order: the simulation's (`start_steps`), so each row starts no earlier
    # than the row above it.
    listed: Sequence[int]
    behind_open: set[str] = set()  # starts that are only the earliest they can be
    if count is not None:
        starts = yield from start_steps(
            state, running_since, now_ns, expected, limit=first + count, open_starts=behind_open
        )
        ranked = list(starts)
        listed = range(first, len(ranked))
    elif caller is not None:
        # Only as far down the queue as its last row: its rows' positions.
        own = [q.request_id for q in state.queue if q.caller == caller]
        starts = yield from start_steps(
            state, running_since, now_ns, expected, own, open_starts=behind_open
        )
        ranked = list(starts)
        mine = [i for i, rid in enumerate(ranked) if state.requests[rid].caller == caller]
        listed = sorted({j for i in mine for j in (i - 1, i) if j >= first})
    else:
        starts = yield from start_steps(
            state, running_since, now_ns, expected, open_starts=behind_open
        )
        ranked = list(starts)
        listed = range(first, len(ranked))
    by_model = state.queue.waiting_by_model()
    blocked: dict[str, WaitsFor] = {}  # depends on the model alone
    waiting = []
    for index in listed:
        item = state.queue.get(ranked[index])
        assert item is not None  # the simulation places waiting requests only
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
                waited_s=wait_ns(item.enqueued_ns, None, now_ns) / NS_PER_S,
                estimated_start_at=start / NS_PER_S,
                estimated_start_in_s=(start - now_ns) / NS_PER_S,
                caller=request.caller,
                waits_for=(
                    blocked.get(item.model)
                    or blocked.setdefault(item.model, waits_for(state, item.model))
                ).for_row(item.request_id),
                estimated_start_open=item.request_id in behind_open,
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
        end = end_of(state, request_id, running_since, now_ns, expected)
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
                expected_end_at=end.at_ns / NS_PER_S,
                expected_end_open=end.open,
                progress=None if request.progress is None else request.progress[:2],
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
