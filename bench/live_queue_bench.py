"""The live queue view (`app.report.live_queue.queue_view`) at depth: what one poll
of the console's queue page costs the event loop. Prints figures, asserts nothing.

    python -m bench.live_queue_bench [--waiting 10000] [--callers 20] [--runs 5]

Builds the core's state with one request running and `--waiting` requests behind
it (3 models, the three bands, `--callers` callers, fair share and short jobs
on), then times, median CPU milliseconds of `--runs`: the whole view (`GET
/api/queue`), an admin's first page (`/ui/api/queue`, a window of 101 rows) and
a user key's page (only its caller's rows and the one ahead of each).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from app.core.scoring import ScoringParams
from app.report.live_queue import queue_view
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
    cases: list[tuple[str, Callable[[], object]]] = [
        ("the whole view", lambda: queue_view(state, since, now, TIMES)),
        ("an admin's first page", lambda: queue_view(state, since, now, TIMES, count=101)),
        ("a user key's page", lambda: queue_view(state, since, now, TIMES, caller="user-3")),
    ]
    print(f"{args.waiting:,} waiting over {args.callers} callers; median CPU of {args.runs} runs")
    for label, run in cases:
        print(f"{label:>22}: {_median_ms(run, args.runs):7.1f} ms")


if __name__ == "__main__":
    main()
