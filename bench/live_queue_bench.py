"""The live queue view (`app.report.live_queue.queue_view`) at depth: what one poll
of the console's queue page costs the event loop. Prints figures, asserts nothing.

    python -m bench.live_queue_bench [--waiting 10000] [--callers 20] [--runs 5]

Builds the core's state with one request running and `--waiting` requests behind
it (3 models, the three bands, `--callers` callers, fair share and short jobs
on), then times, median CPU milliseconds of `--runs`: the whole view (`GET
/api/queue`), an admin's first page (`/ui/api/queue`, a window of 101 rows) and
a user key's page (only its caller's rows and the one ahead of each). For each,
also what the web routes hold the event loop for (app/web/live_queue_view.py): a
view that does not end in its first slice is computed on a `snapshot()` of the
state in slices (`queue_view_steps`); the longest of those (the snapshot
included in the first), median of `--runs`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Generator
from typing import Any

from app.core.scoring import ScoringParams
from app.core.state import SchedulerState
from app.report.live_queue import queue_view, queue_view_steps
from app.report.run_times import RunTimes
from tests.unit.core_driver import CoreDriver

TIMES = RunTimes({"a": 5.0, "b": 6.0, "c": 7.0}, {"a": 1.0, "b": 1.0, "c": 1.0})


def _median_ms(run: Callable[[], object], runs: int) -> float:
    samples = []
    for _ in range(runs):
        t = time.process_time()
        run()
        samples.append((time.process_time() - t) * 1000)
    return statistics.median(samples)


def _longest_slice_ms(state: SchedulerState, run: Callable[[SchedulerState], object]) -> float:
    """The longest CPU stretch between two yields, the snapshot counted in the first."""
    t = time.process_time()
    steps = run(state.snapshot())
    assert isinstance(steps, Generator)
    longest = 0.0
    while True:
        try:
            next(steps)
        except StopIteration:
            return max(longest, (time.process_time() - t) * 1000)
        now = time.process_time()
        longest, t = max(longest, (now - t) * 1000), now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waiting", type=int, default=10_000)
    ap.add_argument("--callers", type=int, default=20)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    rng = random.Random(1)
    d = CoreDriver(ScoringParams(fair_share_bonus=20, short_job_bonus=20))
    d.enqueue("running", "a", 0, caller="user-0")
    d.step()
    for i in range(args.waiting):
        d.advance(1_000_000)
        caller = f"user-{rng.randrange(args.callers)}"
        d.enqueue(f"r{i}", rng.choice("abc"), rng.choice([100, 0, -100]), caller=caller)
    state, now = d.state, d.now
    since = dict.fromkeys(state.running, now)
    windows: list[tuple[str, dict[str, Any]]] = [
        ("the whole view", {}),
        ("an admin's first page", {"count": 101}),
        ("a user key's page", {"caller": "user-3"}),
    ]
    print(f"{args.waiting:,} waiting over {args.callers} callers; median CPU of {args.runs} runs")
    print(f"{'':>22}  {'at once':>8}  {'longest slice':>13}")
    for label, kw in windows:

        def at_once(kw: dict[str, Any] = kw) -> object:
            return queue_view(state, since, now, TIMES, **kw)

        def sliced(copy: SchedulerState, kw: dict[str, Any] = kw) -> object:
            return queue_view_steps(copy, since, now, TIMES, **kw)

        whole = _median_ms(at_once, args.runs)
        longest = statistics.median(_longest_slice_ms(state, sliced) for _ in range(args.runs))
        print(f"{label:>22}: {whole:5.1f} ms  {longest:10.1f} ms")


if __name__ == "__main__":
    main()
