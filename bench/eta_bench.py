"""How far off is a run's estimated finish? The film's render chains, checked against their log.

    python -m tools.replay generate film --days 2 --out /tmp/film.db
    python -m bench.eta_bench /tmp/film.db [--caller render] [--at 10,25,50,75,100,125,150,170]

The log is folded with the core's `apply`, event by event, as the server's
state was, and the `LaneHistory` learns from the same events as the server's
(app/core/overtaking.py). The caller's requests form chains: a request
enqueued more than `GAP_S` after the previous one ended starts a new chain (the
film's render, one a day). When shot k of a chain is submitted, the estimate
is computed as the server computes a run's (`app/report/progress.py`): the
state as of then, the dispatch times of what runs, run and load medians learnt
from the log so far (as `load_run_times` learns them: the last 2000 completed
runs and 500 loads), the chain's open shot, and its shots still to come
counted as lines not queued yet. It is compared with when the chain's last
shot actually ended, as a share of the time left: `floor` is the estimate as
it was before the forecast (the queue as it stands), `estimated` adds the
overtaking work and the producer's mean gap between shots so far, with the
80% interval. A chain whose day has no earlier day in the log is forecast from
today's rate so far (docs/jobs.md, "The finish estimate").
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque

from app.core import events as ev
from app.core.lane_history import LaneHistory
from app.core.scoring import NS_PER_S
from app.core.state import SchedulerState, apply
from app.report.progress import progress
from app.report.render import duration
from app.report.run_times import RECENT_REQUESTS, RECENT_SWAPS, RunTimes, recent_by_model
from tools.replay.workload import iter_log

GAP_S = 600.0
"""A request enqueued this long after its caller's previous one ended starts a new chain."""


def _times(runs: deque[tuple[str, float]], swaps: deque[tuple[str, float]]) -> RunTimes:
    def medians(samples: deque[tuple[str, float]]) -> tuple[dict[str, float], float]:
        by: dict[str, list[float]] = {}
        for model, s in samples:
            by.setdefault(model, []).append(s)
        every = [s for _, s in samples]
        overall = statistics.median(every) if every else 0.0
        return {m: statistics.median(v) for m, v in by.items()}, overall

    run_s, default_run = medians(runs)
    swap_s, default_swap = medians(swaps)
    return RunTimes(run_s, swap_s, default_run, default_swap, recent_by_model(runs))


def chains_of(
    events: list[ev.AnyEvent], caller: str
) -> tuple[list[list[ev.RequestEnqueued]], dict[str, int]]:
    """The caller's chains (split where a request came `GAP_S` after the previous
    one ended), and when each of its requests ended."""
    mine = [e for e in events if isinstance(e, ev.RequestEnqueued) and e.caller == caller]
    ids = {e.request_id for e in mine}
    ended = {
        e.request_id: e.at
        for e in events
        if isinstance(e, ev.RequestCompleted | ev.RequestFailed | ev.RequestCancelled)
        and e.request_id in ids
    }
    chains: list[list[ev.RequestEnqueued]] = []
    for e in mine:
        before = chains[-1][-1] if chains else None
        end = None if before is None else ended.get(before.request_id)
        if before is None or (end is not None and e.at - end > GAP_S * NS_PER_S):
            chains.append([])
        chains[-1].append(e)
    return chains, ended


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.eta_bench", description=__doc__)
    parser.add_argument("db", help="a log, e.g. from `python -m tools.replay generate film`")
    parser.add_argument("--caller", default="render", help="the chains' caller (default render)")
    parser.add_argument(
        "--at", default="10,25,50,75,100,125,150,170", help="shots done at each check"
    )
    args = parser.parse_args(argv)
    points = sorted({int(x) for x in args.at.split(",")})

    events = [e for _, e in iter_log(args.db)]
    chains, ended = chains_of(events, args.caller)
    chains = [c for c in chains if c[-1].request_id in ended]
    if not chains:
        print(f"no finished chain of caller {args.caller!r} in {args.db}")
        return 1
    checks: dict[str, tuple[int, int, int]] = {}  # request id -> (chain, k, total)
    for n, chain in enumerate(chains):
        for k, e in enumerate(chain):
            if k in points:
                checks[e.request_id] = (n, k, len(chain))
    rows: list[list[str]] = [[] for _ in chains]
    floor_errors: list[list[float]] = [[] for _ in chains]
    errors: list[list[float]] = [[] for _ in chains]
    within = [0 for _ in chains]
    cost: list[tuple[float, float]] = []  # seconds per estimate: (floor, forecast)

    state = SchedulerState()
    history = LaneHistory()
    running_since: dict[str, int] = {}
    started: dict[str, int] = {}
    runs: deque[tuple[str, float]] = deque(maxlen=RECENT_REQUESTS)
    swaps: deque[tuple[str, float]] = deque(maxlen=RECENT_SWAPS)
    models: dict[str, str] = {}
    learning = 0.0  # seconds in history.observe, as the server's emit spends them
    for e in events:
        t = time.perf_counter()
        history.observe(e, state)
        learning += time.perf_counter() - t
        apply(state, e)
        if isinstance(e, ev.RequestEnqueued):
            models[e.request_id] = e.model
        elif isinstance(e, ev.RequestDispatched):
            running_since[e.request_id] = e.at
        elif isinstance(e, ev.RequestStarted):
            started[e.request_id] = e.at
        elif isinstance(e, ev.SwapFinished):
            swaps.append((e.model, e.duration_ms / 1000.0))
        elif isinstance(e, ev.RequestCompleted):
            begun = started.pop(e.request_id, None)
            if begun is not None:
                runs.append((models[e.request_id], (e.at - begun) / NS_PER_S))
            running_since.pop(e.request_id, None)
        elif isinstance(e, ev.RequestFailed | ev.RequestCancelled):
            running_since.pop(e.request_id, None)
            started.pop(e.request_id, None)
        if not (isinstance(e, ev.RequestEnqueued) and e.request_id in checks):
            continue
        n, k, total = checks[e.request_id]
        times = _times(runs, swaps)
        rest = [e.model] * (total - k - 1)
        # The producer's gap so far: from a shot's end to the next one's enqueue.
        chain = chains[n]
        gaps = [
            (chain[j].at - ended[chain[j - 1].request_id]) / NS_PER_S
            for j in range(1, k + 1)
            if ended[chain[j - 1].request_id] <= chain[j].at
        ]
        gap = statistics.mean(gaps) if gaps else 0.0
        args_ = (state, running_since, e.at, times, [e.request_id])
        t0 = time.perf_counter()
        floor = progress(*args_, done=k, failed=0, unqueued_models=rest)
        t1 = time.perf_counter()
        p = progress(*args_, done=k, failed=0, unqueued_models=rest, history=history, gap_s=gap)
        cost.append((t1 - t0, time.perf_counter() - t1))
        assert floor.estimated_finish_at is not None and p.estimated_finish_at is not None
        assert p.basis is not None
        now_s = e.at / NS_PER_S
        finish_s = ended[chains[n][-1].request_id] / NS_PER_S
        left = finish_s - now_s
        floor_error = (floor.estimated_finish_at - now_s - left) / left
        error = (p.estimated_finish_at - now_s - left) / left
        floor_errors[n].append(abs(floor_error))
        errors[n].append(abs(error))
        low, high = p.estimated_finish_low_at, p.estimated_finish_high_at
        held = low is not None and low <= finish_s and (high is None or finish_s <= high)
        within[n] += held
        span = (
            f"{duration((low or now_s) - now_s)}-{'?' if high is None else duration(high - now_s)}"
        )
        b = p.basis
        rows[n].append(
            f"{k:>5} {duration(left):>9} {floor_error:>+7.1%} "
            f"{duration(p.estimated_finish_at - now_s):>9} {error:>+7.1%} "
            f"{span:>15} {'yes' if held else 'no':>4}  "
            f"{b.ahead} ahead, {b.overtaking} overtaking, {b.earlier_days} earlier days"
        )
    for n, chain in enumerate(chains):
        day = duration((ended[chain[-1].request_id] - chain[0].at) / NS_PER_S)
        print(
            f"chain {n + 1} of caller {args.caller}: {len(chain)} jobs, "
            f"the last ends {day} after the first"
        )
        print(
            f"{'done':>5} {'left':>9} {'floor':>7} {'estimated':>9} {'error':>7} "
            f"{'80% interval':>15} {'in':>4}  basis"
        )
        for row in rows[n]:
            print(row)
        if errors[n]:
            print(
                f"floor:    mean |error| {statistics.mean(floor_errors[n]):.1%}, "
                f"worst {max(floor_errors[n]):.1%}"
            )
            print(
                f"forecast: mean |error| {statistics.mean(errors[n]):.1%}, "
                f"worst {max(errors[n]):.1%}"
            )
            print(f"within the interval: {within[n]} of {len(errors[n])}")
        print()
    print(
        f"cost per estimate (median of {len(cost)}): floor "
        f"{statistics.median(c[0] for c in cost) * 1000:.2f} ms, with the forecast "
        f"{statistics.median(c[1] for c in cost) * 1000:.2f} ms; learning "
        f"{learning / len(events) * 1e6:.1f} us per event"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
