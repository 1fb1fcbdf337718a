"""Benchmark of the replay's several-lane simulation (`--config`): the film
scenario's days under one lane (the fast loop), the several-lane loop on a router
that allows one model at a time (the same decisions), and two GPU groups with four
chat slots (`tools/replay/whatif/film-both.yaml`). Best of `--repeat`, in one
process, so the ratios are side by side. Prints figures, asserts nothing.

    python -m bench.replay_lanes_bench [--days 20] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from app.core.residency import Group, GroupRouter
from app.core.scoring import NS_PER_S, ScoringParams
from tools.replay.generate import CHAT, IMAGE, VIDEO, film
from tools.replay.simulate import Policy, simulate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--days", type=int, default=20)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    workload = film(1, days=args.days).workload
    base = Policy("one lane", ScoringParams(60 * NS_PER_S, 10))
    one_group = GroupRouter(groups=(Group(name="all", members=(CHAT, IMAGE, VIDEO)),))
    two_gpus = GroupRouter(
        groups=(
            Group(name="gpu0", members=(CHAT,), exclusive=False),
            Group(name="gpu1", members=(IMAGE, VIDEO), exclusive=False),
        )
    )
    runs = [
        ("one lane (the fast loop)", base),
        ("lanes loop, one group of all", replace(base, router=one_group)),
        ("lanes loop, two GPUs + 4 chat slots", replace(base, router=two_gpus, slots=((CHAT, 4),))),
    ]
    first = None
    for label, policy in runs:
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            simulate(workload, policy)
            best = min(best, time.perf_counter() - t0)
        first = first or best
        print(
            f"{label:<40} {len(workload.requests)} requests  {best:.3f} s  "
            f"{best / len(workload.requests) * 1e6:.1f} us/request  x{best / first:.2f}"
        )


if __name__ == "__main__":
    main()
