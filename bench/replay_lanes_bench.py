"""Benchmark of the replay with groups and slots (`--config`; issue 23): the film
trace under one lane, on a router of one group of every model (one model at a time:
it takes the one-lane loop), and on two GPU groups with four chat slots
(`tools/replay/whatif/film-both.yaml`: the several-lane loop), each with the default
parameters and with every term on. Prints figures, asserts nothing.

    python -m bench.replay_lanes_bench [--requests 100000] [--rounds 3]

The arms run one after another in every round, in an order that reverses each
round, in one process; each arm's CPU time is divided by the one lane's (the same
terms) in the same round, and the median of the rounds' ratios is printed, since
the shared host's speed moves 2x from day to day and within a run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

from app.core.residency import Group, GroupRouter
from app.core.scoring import NS_PER_S, ScoringParams
from tools.replay.generate import CHAT, IMAGE, VIDEO, film
from tools.replay.simulate import Policy, simulate

REQUESTS_PER_DAY = 520  # about: the film scenario's working day


def arms() -> list[tuple[str, str, Policy]]:
    """(label, the one-lane arm it is compared with, policy)."""
    default = Policy("default", ScoringParams())
    every = Policy(
        "every term", ScoringParams(60 * NS_PER_S, 10, fair_share_bonus=10, short_job_bonus=10)
    )
    one_group = GroupRouter(groups=(Group(name="all", members=(CHAT, IMAGE, VIDEO)),))
    two_gpus = GroupRouter(
        groups=(
            Group(name="gpu0", members=(CHAT,), exclusive=False),
            Group(name="gpu1", members=(IMAGE, VIDEO), exclusive=False),
        )
    )
    out: list[tuple[str, str, Policy]] = []
    for terms, base in (("default", default), ("every term", every)):
        one = f"one lane, {terms}"
        out += [
            (one, one, base),
            (f"one group of all, {terms}", one, replace(base, router=one_group)),
            (
                f"two GPUs + 4 chat slots, {terms}",
                one,
                replace(base, router=two_gpus, slots=((CHAT, 4),)),
            ),
        ]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    t = time.perf_counter()
    days = args.requests // REQUESTS_PER_DAY + 2
    workload = film(1, days=days, limit=args.requests).workload
    n = len(workload.requests)
    print(f"trace: {n:,} film requests ({days} days) built in {time.perf_counter() - t:.1f} s")
    runs = arms()
    cpu: dict[str, list[float]] = {label: [] for label, _, _ in runs}
    dispatches: dict[str, int] = {}
    for r in range(args.rounds):
        for label, _, policy in runs if r % 2 == 0 else runs[::-1]:
            c0 = time.process_time()
            result = simulate(workload, policy)
            cpu[label].append(time.process_time() - c0)
            dispatches[label] = len(result.order)
    print(
        f"CPU s, median of {args.rounds} rounds [range]; x: median of the rounds' "
        "ratios to one lane with the same terms"
    )
    for label, base, _ in runs:
        ratio = statistics.median(a / b for a, b in zip(cpu[label], cpu[base], strict=True))
        s = cpu[label]
        print(
            f"  {label:<36} {statistics.median(s):7.2f} s [{min(s):.2f}-{max(s):.2f}] "
            f"{statistics.median(s) / n * 1e6:6.1f} us/request  x{ratio:.2f}  "
            f"({dispatches[label]:,} dispatches)"
        )
    every, default = cpu["one lane, every term"], cpu["one lane, default"]
    ratio = statistics.median(a / b for a, b in zip(every, default, strict=True))
    print(f"  one lane, every term / default: x{ratio:.2f}")
    every, default = (
        cpu["two GPUs + 4 chat slots, every term"],
        cpu["two GPUs + 4 chat slots, default"],
    )
    ratio = statistics.median(a / b for a, b in zip(every, default, strict=True))
    print(f"  two GPUs + 4 chat slots, every term / default: x{ratio:.2f}")


if __name__ == "__main__":
    main()
