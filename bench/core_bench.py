"""Benchmark of the scheduling queue (app/core/queue.py). Prints figures, asserts nothing.

    python -m bench.core_bench [--ops 1000] [--sizes 1000,10000,100000,1000000] [--rounds 1]

For each queue size, builds a queue of that many requests over 3 models (priorities drawn
from the bands and their tier offsets, enqueue times one millisecond apart), then times
`--ops` single operations of each kind, keeping the size steady, twice: with the
designed score, and with every term on (fairShareBonus 20 over 8 callers whose
fair-share terms move at every pick, as charging moves them, and shortJobBonus 20
with expected run times of 6 s to 16 min):

- enqueue: `push` of a new request (then an untimed cancel of a random one);
- pick:    `pick` plus `remove` of the winner, i.e. one dispatch (then an untimed push);
- cancel:  `remove` of a random queued id (then an untimed push).

`--rounds R` builds and times every cell R times, the rounds interleaved, and prints
the median of the rounds' medians with their range: on a shared host one round's
median can move 1.8x with the load.

Memory is the tracemalloc difference across building the queue, divided by its length:
everything the queue holds per request (ids, `Queued` structs, dict slots, heap entries).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable

from app.core.queue import Queued, ScoreQueue
from app.core.scoring import NS_PER_S, ScoringParams

MODELS = ("llama-8b", "qwen-32b", "flux-dev")
PRIORITIES = (102, 101, 100, 2, 1, 0, 0, 0, -98, -99, -100, -100)
STEP_NS = 1_000_000  # one enqueue per millisecond
PARAMS = ScoringParams(aging_divisor_ns=60 * NS_PER_S, swap_affinity_bonus=10)
ALL_TERMS = ScoringParams(
    aging_divisor_ns=60 * NS_PER_S, swap_affinity_bonus=10, fair_share_bonus=20, short_job_bonus=20
)
CALLERS = tuple(f"member-{i}" for i in range(8))
RUNS_NS = tuple(s * NS_PER_S for s in (6, 6, 6, 30, 240, 960))
TERMS = (("off", PARAMS), ("all", ALL_TERMS))
KINDS = ("enqueue", "pick", "cancel")


class Workload:
    """A queue plus the ids it holds, so a random queued id is O(1) to find and drop."""

    def __init__(self, seed: int, params: ScoringParams = PARAMS) -> None:
        self.rng = random.Random(seed)
        self.terms = params.fair_share_bonus != 0
        self.queue = ScoreQueue(params)
        self.ids: list[str] = []
        self.slot: dict[str, int] = {}
        self.order = 0

    def new_item(self) -> Queued:
        n = self.order
        self.order += 1
        return Queued(
            request_id=f"{n:032x}",  # as long as a uuid4 hex
            model=self.rng.choice(MODELS),
            priority=self.rng.choice(PRIORITIES),
            enqueued_ns=1_700_000_000 * NS_PER_S + n * STEP_NS,
            order=n,
            caller=self.rng.choice(CALLERS) if self.terms else None,
            expected_run_ns=self.rng.choice(RUNS_NS) if self.terms else None,
        )

    def fair(self) -> dict[str | None, int]:
        """Each caller's fair-share term, moved at random as charging moves it."""
        if not self.terms:
            return {}
        full = ALL_TERMS.fair_share_bonus * ALL_TERMS.scale
        return {c: full * self.rng.randrange(101) // 100 for c in CALLERS}

    def track(self, request_id: str) -> None:
        self.slot[request_id] = len(self.ids)
        self.ids.append(request_id)

    def untrack(self, request_id: str) -> None:
        i = self.slot.pop(request_id)
        last = self.ids.pop()
        if last != request_id:
            self.ids[i] = last
            self.slot[last] = i

    def fill(self, n: int) -> None:
        for _ in range(n):
            item = self.new_item()
            self.queue.push(item)
            self.track(item.request_id)

    def random_id(self) -> str:
        return self.ids[self.rng.randrange(len(self.ids))]


def _time(ops: int, setup: Callable[[], object], op: Callable[[object], object]) -> list[int]:
    clock = time.perf_counter_ns
    samples = []
    for _ in range(ops):
        arg = setup()
        t0 = clock()
        op(arg)
        samples.append(clock() - t0)
    return samples


def bench_ops(
    n: int, ops: int, resident: str, params: ScoringParams = PARAMS
) -> dict[str, list[int]]:
    w = Workload(seed=n, params=params)
    w.fill(n)
    q = w.queue
    out: dict[str, list[int]] = {}

    # enqueue: time push, then cancel a random request (untimed) to stay at n.
    pushed: list[str] = []

    def push_op(item: object) -> None:
        assert isinstance(item, Queued)
        q.push(item)
        pushed.append(item.request_id)

    def push_setup() -> Queued:
        while pushed:
            w.track(pushed.pop())
            rid = w.random_id()
            q.remove(rid)
            w.untrack(rid)
        return w.new_item()

    out["enqueue"] = _time(ops, push_setup, push_op)
    push_setup()

    # pick: one dispatch = pick + remove of the winner, then push (untimed) to stay at n.
    winners: list[str] = []

    def pick_op(fair: object) -> None:
        assert isinstance(fair, dict)
        p = q.pick(resident, fair)
        assert p is not None
        q.remove(p.winner.request_id)
        winners.append(p.winner.request_id)

    def pick_setup() -> dict[str | None, int]:
        while winners:
            w.untrack(winners.pop())
            item = w.new_item()
            q.push(item)
            w.track(item.request_id)
        return w.fair()

    out["pick"] = _time(ops, pick_setup, pick_op)
    pick_setup()

    # cancel: remove a random queued id, then push (untimed) to stay at n.
    cancelled: list[str] = []

    def cancel_op(rid: object) -> None:
        assert isinstance(rid, str)
        q.remove(rid)

    def cancel_setup() -> str:
        while cancelled:
            w.untrack(cancelled.pop())
            item = w.new_item()
            q.push(item)
            w.track(item.request_id)
        rid = w.random_id()
        cancelled.append(rid)
        return rid

    out["cancel"] = _time(ops, cancel_setup, cancel_op)
    return out


def bytes_per_request(n: int) -> float:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    w = Workload(seed=n)
    q = w.queue
    for _ in range(n):
        q.push(w.new_item())
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(q) == n
    return (after - before) / n


def _fmt_us(ns: float) -> str:
    return f"{ns / 1000:8.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=1000)
    parser.add_argument("--sizes", default="1000,10000,100000,1000000")
    parser.add_argument("--memory-sizes", default="100000,1000000")
    parser.add_argument("--rounds", type=int, default=1, help="rounds per cell (median shown)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    started = time.perf_counter()

    print(
        f"core queue: {len(MODELS)} models, resident {MODELS[0]}, "
        f"agingDivisor {PARAMS.aging_divisor_ns / NS_PER_S:g}s, "
        f"bonus {PARAMS.swap_affinity_bonus}, {args.ops} timed ops per cell"
    )
    cells = [(n, label, params) for n in sizes for label, params in TERMS]
    medians: dict[tuple[int, str, str], list[float]] = {}
    p99s: dict[tuple[int, str, str], list[int]] = {}
    for _ in range(max(1, args.rounds)):
        for n, label, params in cells:
            res = bench_ops(n, args.ops, MODELS[0], params)
            for kind in KINDS:
                s = sorted(res[kind])
                medians.setdefault((n, label, kind), []).append(statistics.median(s))
                p99s.setdefault((n, label, kind), []).append(s[min(len(s) - 1, int(len(s) * 0.99))])
            gc.collect()
    if args.rounds > 1:
        print(f"median of {args.rounds} rounds' medians [their range] (p99, median of rounds)")
    else:
        print("median (p99) microseconds per operation")
    print(f"{'queued':>9} {'terms':>5} | {'enqueue':>18} | {'pick+remove':>18} | {'cancel':>18}")
    for n, label, _ in cells:
        row = []
        for kind in KINDS:
            ms, p99 = medians[(n, label, kind)], p99s[(n, label, kind)]
            cell = (
                f"{_fmt_us(statistics.median(ms))} ({_fmt_us(statistics.median(p99)).strip():>7})"
            )
            if args.rounds > 1:
                cell += f" [{min(ms) / 1000:.2f}-{max(ms) / 1000:.2f}]"
            row.append(cell)
        print(f"{n:>9} {label:>5} | " + " | ".join(row))

    print("memory held per queued request (tracemalloc)")
    for n in [int(s) for s in args.memory_sizes.split(",") if s]:
        print(f"{n:>9} | {bytes_per_request(n):8.0f} bytes")
        gc.collect()
    print(f"total {time.perf_counter() - started:.1f}s")


if __name__ == "__main__":
    main()
