"""How far off is a run's estimated finish? The film's render chain, checked against its log.

    python -m tools.replay generate film --out /tmp/film.db
    python -m bench.eta_bench /tmp/film.db [--caller render] [--at 0,25,50,100,150,170]

The log is folded with the core's `apply`, event by event, as the server's
state was. When shot k of the chain (the caller's k-th request) is submitted,
the estimate is computed as the server computes a batch's
(`app/report/progress.py`): the state as of then, the dispatch times of what
runs, run and load medians learnt from the log so far (as `load_run_times`
learns them: the last 2000 completed runs and 500 loads), the chain's open
shot, and its shots still to come counted as lines not queued yet. It is
compared with when the chain's last shot actually ended. Printed per point:
the estimate, the actual finish, and the error as a share of the time left.
"""

from __future__ import annotations

import argparse
import statistics
from collections import deque

from app.core import events as ev
from app.core.scoring import NS_PER_S
from app.core.state import SchedulerState, apply
from app.report.progress import progress
from app.report.render import duration
from app.report.run_times import RECENT_REQUESTS, RECENT_SWAPS, RunTimes
from tools.replay.workload import iter_log


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
    return RunTimes(run_s, swap_s, default_run, default_swap)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.eta_bench", description=__doc__)
    parser.add_argument("db", help="a log, e.g. from `python -m tools.replay generate film`")
    parser.add_argument("--caller", default="render", help="the chain's caller (default render)")
    parser.add_argument("--at", default="0,25,50,100,150,170", help="shots done at each check")
    args = parser.parse_args(argv)
    points = sorted({int(x) for x in args.at.split(",")})

    events = [e for _, e in iter_log(args.db)]
    chain = [e for e in events if isinstance(e, ev.RequestEnqueued) and e.caller == args.caller]
    ids = [e.request_id for e in chain]
    order = {rid: i for i, rid in enumerate(ids)}
    ended = {
        e.request_id: e.at
        for e in events
        if isinstance(e, ev.RequestCompleted | ev.RequestFailed | ev.RequestCancelled)
        and e.request_id in order
    }
    if not ids or ids[-1] not in ended:
        print(f"no finished chain of caller {args.caller!r} in {args.db}")
        return 1
    finish = ended[ids[-1]]
    total = len(ids)
    span = duration((finish - chain[0].at) / NS_PER_S)
    print(f"chain of caller {args.caller}: {total} jobs, the last ends {span} after the first")
    print(f"{'done':>5} {'left (actual)':>14} {'estimated':>10} {'error':>8}  basis")

    state = SchedulerState()
    running_since: dict[str, int] = {}
    started: dict[str, int] = {}
    runs: deque[tuple[str, float]] = deque(maxlen=RECENT_REQUESTS)
    swaps: deque[tuple[str, float]] = deque(maxlen=RECENT_SWAPS)
    models: dict[str, str] = {}
    errors = []
    for e in events:
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
        if not (isinstance(e, ev.RequestEnqueued) and e.request_id in order):
            continue
        k = order[e.request_id]
        if k not in points:
            continue
        times = _times(runs, swaps)
        model = e.model
        p = progress(
            state,
            running_since,
            e.at,
            times,
            [e.request_id],
            done=k,
            failed=0,
            unqueued_models=[model] * (total - k - 1),
        )
        assert p.estimated_finish_at is not None and p.basis is not None
        left = (finish - e.at) / NS_PER_S
        estimated = p.estimated_finish_at - e.at / NS_PER_S
        error = (estimated - left) / left
        errors.append(abs(error))
        b = p.basis
        print(
            f"{k:>5} {duration(left):>14} {duration(estimated):>10} {error:>+7.1%}  "
            f"median run {model} {duration(b.run_s[model])}, {b.ahead} ahead, {b.swaps} loads"
        )
    if errors:
        print(f"mean |error| {statistics.mean(errors):.1%}, worst {max(errors):.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
