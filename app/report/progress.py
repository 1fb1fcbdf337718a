"""Progress and an estimated finish for a run of jobs: a batch, or a chain.

Pure, like the live queue it builds on: the caller passes the state, the
dispatch times of what is running, `now`, the measured run times and which of
the run's jobs are open (its ended lines are counted by the caller, from the
log). The estimate is the live queue's own, the one estimator of
app/core/start_estimate.py (`Retry-After`'s too): the queue as it stands, in its
dispatch order, each request taking its learnt run time (else its model's) on a
slot of its model, and each load waiting for what it evicts to drain. The run ends when
its last open job is expected to end, plus, for lines not queued yet (a batch
still queueing, the shots of a chain still to be submitted), one median run
each after that: the floor. Given the log's `LaneHistory`, the work that will
arrive later and overtake the run is forecast and added, with an 80% interval
(app/core/overtaking.py; docs/jobs.md measures the error on the film scenario).

`Basis` says what the figure rests on: how many other requests are expected to
go first (in the queue now, and arriving later), how many model loads, the
medians used, and how many earlier days the forecast rests on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping

import msgspec

from app.core.lane_history import LaneHistory
from app.core.overtaking import forecast_finish
from app.core.priority import ALIASES
from app.core.scoring import NS_PER_S
from app.core.start_estimate import end_of, evicted_by
from app.core.state import SchedulerState
from app.report.live_queue import Times, durations, estimate_starts

MIN_OWN_RUNS = 10
"""Runs of a run's own kind (model and priority) before their mean is trusted."""


class Basis(msgspec.Struct, frozen=True):
    """What an estimated finish rests on."""

    ahead: int
    """Other requests expected to start before the run's last queued job."""
    swaps: int
    """Model loads expected before then (the run's own included)."""
    run_s: dict[str, float]
    """Median run time per model of the run's jobs, learnt from the log."""
    swap_s: dict[str, float]
    """Median load time of those models."""
    unqueued: int = 0
    """Jobs not in the queue yet, counted at one median run each after the rest."""
    overtaking: int = 0
    """Requests expected to arrive later and go first (the forecast), before the
    estimated finish."""
    earlier_days: int = 0
    """Earlier days of the log the forecast rests on (the fewest of any hour it
    covers); 0: some hour has none, and is forecast from today's rate so far
    (nothing, with less than 30 minutes of it)."""


class Progress(msgspec.Struct, frozen=True):
    total: int
    done: int
    """Ended with a success."""
    failed: int
    """Ended otherwise (an error answer, a failure, cancelled, expired, refused)."""
    running: int
    waiting: int
    """In the queue, or not queued yet."""
    estimated_finish_at: float | None = None
    """Unix seconds when its last job is expected to end; None once nothing is open."""
    estimated_finish_in_s: float | None = None
    basis: Basis | None = None
    estimated_finish_low_at: float | None = None
    """The 80% interval's early end (unix seconds); None when unknown."""
    estimated_finish_high_at: float | None = None
    """Its late end; None when unknown (a log too short to extrapolate from)."""
    estimated_finish_low_in_s: float | None = None
    estimated_finish_high_in_s: float | None = None
    estimated_finish_open: bool = False
    """A job of the run has, or waits behind, a run longer than any run of its
    model (app/core/start_estimate.py): the finish is the earliest it can be,
    and no late end is known (`estimated_finish_high_at` is None)."""


def ended_well(status: str | None, http_status: int | None) -> bool:
    """Whether a run's line no longer open counts as done (else failed), from its
    `requests` row: a success answer, or a row not yet past queued/running (it
    ended a moment ago; the log's group commit is on its way)."""
    if status is None or status in ("queued", "running"):
        return True
    return status == "completed" and 200 <= (http_status or 0) < 300


def progress(
    state: SchedulerState,
    running_since: Mapping[str, int],
    now_ns: int,
    times: Times,
    open_ids: Collection[str],
    *,
    done: int,
    failed: int,
    unqueued_models: Collection[str] = (),
    history: LaneHistory | None = None,
    gap_s: float = 0.0,
) -> Progress:
    """The progress of a run whose open jobs are `open_ids` (those not open in
    `state` are taken as ended: the caller counted them in `done`/`failed`),
    with `unqueued_models` the model of each line not queued yet. With
    `history`, the estimate adds the forecast of overtaking work and gives an
    interval; without, it is the floor and the interval unknown. `gap_s`: the
    time between one job ending and the next being queued (a chain's producer,
    which sends a shot once the last one is done), before each line not queued
    yet."""
    waiting = [rid for rid in open_ids if rid in state.queue]
    running = [rid for rid in open_ids if rid in state.requests and rid not in state.queue]
    total = done + failed + len(waiting) + len(running) + len(unqueued_models)
    pending = len(waiting) + len(running) + len(unqueued_models)
    if not pending:
        return Progress(total, done, failed, 0, 0)
    models: set[str] = set(unqueued_models)
    expected = durations(times)
    finish = now_ns
    open_end = False  # some job of the run has (or waits behind) a run with no known end
    for rid in running:
        models.add(state.running.get(rid) or state.requests[rid].model)
        end = end_of(state, rid, running_since, now_ns, expected)
        finish = max(finish, end.at_ns)
        open_end = open_end or end.open
    ahead = 0
    swaps = 0
    if waiting:
        behind_open: set[str] = set()
        starts = estimate_starts(state, running_since, now_ns, expected, waiting, behind_open)
        open_end = open_end or any(rid in behind_open for rid in waiting)
        mine = set(waiting)
        in_use = set(state.in_use)
        requests = state.requests
        for rid, start in starts.items():  # in dispatch order
            model = requests[rid].model
            if model not in in_use:
                swaps += 1
                in_use -= evicted_by(state, model, in_use)
                in_use.add(model)
            if rid in mine:
                models.add(model)
                finish = max(finish, start + expected.of(model, requests[rid].expected_run_ns))
            else:
                ahead += 1
    finish += int(len(unqueued_models) * gap_s * NS_PER_S)
    low = high = None
    overtaking = earlier_days = 0
    if history is None:
        for model in unqueued_models:
            finish += expected.run(model)
    else:
        # The run's lowest priority: its last jobs go after whatever outranks that.
        priority = min(
            (state.requests[rid].priority for rid in (*waiting, *running)),
            default=ALIASES["batch"],  # nothing queued yet: a batch's default
        )
        # Lines not queued yet take the mean of the run's own kind of job (its
        # model at its priority), not the model's median, which mixes in others'.
        # Their spread adds up over the lines, and the mean's own error (from n
        # runs) is the same for every line: variance L·var + L²·var/n.
        own_var = 0.0
        for model, lines in Counter(unqueued_models).items():
            n, mean_s, var_s2 = history.run_stats(model, priority)
            if n >= MIN_OWN_RUNS:
                finish += lines * int(mean_s * NS_PER_S)
                own_var += var_s2 * lines * (1 + lines / n)
            else:
                finish += lines * expected.run(model)
        # Others' open requests: today's arrivals the history learns once they end.
        own_ids = {*waiting, *running}
        open_work = [
            (
                r.enqueued_ns,
                state.running.get(rid) or r.model,
                r.priority,
                expected.of(r.model, r.expected_run_ns) / NS_PER_S,
            )
            for rid, r in state.requests.items()
            if rid not in own_ids
        ]
        lane = {
            m
            for m in history.models | set(state.in_use)
            if m in models or evicted_by(state, m, models)
        }
        f = forecast_finish(
            history,
            now_ns,
            finish,
            priority=priority,
            lane=lane,
            run_models=models,
            own_var_s2=own_var,
            open_work=open_work,
        )
        finish, low, high = f.finish_ns, f.low_ns, f.high_ns
        overtaking, earlier_days = f.overtaking, f.earlier_days
    if open_end:
        high = None  # no late end is known
    return Progress(
        total=total,
        done=done,
        failed=failed,
        running=len(running),
        waiting=len(waiting) + len(unqueued_models),
        estimated_finish_at=finish / NS_PER_S,
        estimated_finish_in_s=(finish - now_ns) / NS_PER_S,
        basis=Basis(
            ahead=ahead,
            swaps=swaps,
            run_s={m: expected.run(m) / NS_PER_S for m in sorted(models)},
            swap_s={m: expected.load(m) / NS_PER_S for m in sorted(models)},
            unqueued=len(unqueued_models),
            overtaking=overtaking,
            earlier_days=earlier_days,
        ),
        estimated_finish_low_at=None if low is None else low / NS_PER_S,
        estimated_finish_high_at=None if high is None else high / NS_PER_S,
        estimated_finish_low_in_s=None if low is None else (low - now_ns) / NS_PER_S,
        estimated_finish_high_in_s=None if high is None else (high - now_ns) / NS_PER_S,
        estimated_finish_open=open_end,
    )
