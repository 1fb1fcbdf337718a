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

Then one dispatch with groups and slots (issue 23), at each size, the arms interleaved
in every round and each arm's median divided by the single lane's in the same round
(`--dispatch-only` prints only this):

- `single lane, queue`: `pick` + `remove` on the queue of 3 models, as above;
- `single lane, state`: `choose` on a `SchedulerState` with no router (3 models, one
  resident, nothing running) + folding its `request_dispatched` (the queue's remove,
  the request marked running);
- `8 groups + slots`: the same on a state with a group router of 8 groups (`swap:
  true, exclusive: false`: 8 GPUs) of 2 models each, `concurrencyLimit` 4; one model
  of each group resident with 3 of its 4 slots taken; the queue spread over the 8
  resident models;
- `8 groups + slots, 4 draining`: as that, and the best 4 requests of all want the
  other model of 4 groups, so those groups drain: every dispatch walks past 4 models
  that cannot start (a second pick, `_dispatch_pick`).

Untimed between ops: the dispatched request completes (its `request_completed`
folded) and a new one for the same model is enqueued, so the queue, each model's
share of it and the slots stay as they were.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable

from app.core import events as ev
from app.core.policy import choose
from app.core.queue import Queued, ScoreQueue
from app.core.residency import Group, GroupRouter
from app.core.scoring import NS_PER_S, ScoringParams
from app.core.state import SchedulerState, apply, fold_for

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


GROUPS = 8
SLOTS = 4
ARMS = (
    "single lane, queue",
    "single lane, state",
    "8 groups + slots",
    "8 groups + slots, 4 draining",
)
_fold_enqueued = fold_for(ev.RequestEnqueued)
_fold_dispatched = fold_for(ev.RequestDispatched)
_fold_completed = fold_for(ev.RequestCompleted)


class DispatchWorkload:
    """A `SchedulerState` built by folding events, for one dispatch arm."""

    def __init__(self, seed: int, arm: str) -> None:
        self.rng = random.Random(seed)
        self.order = 0
        if arm == ARMS[1]:
            self.state = SchedulerState(PARAMS)
            self.models: tuple[str, ...] = MODELS
            resident = [MODELS[0]]
        else:
            pairs = [(f"g{j}-a", f"g{j}-b") for j in range(GROUPS)]
            router = GroupRouter(
                groups=tuple(
                    Group(name=f"gpu{j}", members=pair, exclusive=False)
                    for j, pair in enumerate(pairs)
                )
            )
            slots = {m: SLOTS for pair in pairs for m in pair}
            self.state = SchedulerState(PARAMS, router=router, concurrency=slots)
            resident = [a for a, _ in pairs]
            self.models = tuple(resident)
        t0 = 1_700_000_000 * NS_PER_S
        for model in resident:
            apply(self.state, ev.SwapFinished(at=t0, model=model, duration_ms=0.0))
        if arm != ARMS[1]:
            for model in resident:  # 3 of each resident model's 4 slots taken, for ever
                for _ in range(SLOTS - 1):
                    rid = self.enqueue(model, 0)
                    apply(self.state, ev.RequestDispatched(at=t0, request_id=rid, model=model))
        if arm == ARMS[3]:
            for j in range(
                4
            ):  # the best requests of all, each for a model that must drain its group
                self.enqueue(f"g{j}-b", 102)

    def enqueue(self, model: str | None = None, priority: int | None = None) -> str:
        n = self.order
        self.order += 1
        rid = f"{n:032x}"
        _fold_enqueued(
            self.state,
            ev.RequestEnqueued(
                at=1_700_000_000 * NS_PER_S + n * STEP_NS,
                request_id=rid,
                model=model or self.rng.choice(self.models),
                model_requested=model or "",
                endpoint="/v1/chat/completions",
                priority=self.rng.choice(PRIORITIES) if priority is None else priority,
                band="normal",
            ),
        )
        return rid


def bench_dispatch(n: int, ops: int, arm: str) -> list[int]:
    """`ops` timed dispatches of one arm at `n` queued."""
    if arm == ARMS[0]:
        return bench_ops(n, ops, MODELS[0])["pick"]
    w = DispatchWorkload(seed=n, arm=arm)
    for _ in range(n):
        w.enqueue()
    state = w.state
    now = 1_800_000_000 * NS_PER_S
    done: list[ev.RequestDispatched] = []

    def dispatch(_: object) -> None:
        found = choose(state, now)
        assert found is not None and (found.action == "run" or arm == ARMS[1])
        _fold_dispatched(state, found.dispatched)
        done.append(found.dispatched)

    def restore() -> None:
        while done:
            dispatched = done.pop()
            if dispatched.swap:  # the single lane: the load ends, its model resident
                apply(state, ev.SwapFinished(at=now, model=dispatched.model, duration_ms=0.0))
            rid = dispatched.request_id
            _fold_completed(state, ev.RequestCompleted(at=now, request_id=rid, http_status=200))
            w.enqueue(dispatched.model)  # for the same model: each model's queue stays as deep

    samples = _time(ops, restore, dispatch)
    restore()
    return samples


def dispatch_table(sizes: list[int], ops: int, rounds: int) -> None:
    print(
        f"one dispatch with groups and slots: median of {rounds} rounds' medians, µs "
        "[range]; x: median of the rounds' ratios to `single lane, queue`"
    )
    medians: dict[tuple[int, str], list[float]] = {}
    for r in range(rounds):
        for n in sizes:
            arms = ARMS if r % 2 == 0 else ARMS[::-1]  # alternate which arm goes first
            for arm in arms:
                s = sorted(bench_dispatch(n, ops, arm))
                medians.setdefault((n, arm), []).append(statistics.median(s))
                gc.collect()
    for n in sizes:
        base = medians[(n, ARMS[0])]
        for arm in ARMS:
            ms = medians[(n, arm)]
            ratio = statistics.median(m / b for m, b in zip(ms, base, strict=True))
            print(
                f"{n:>9} {arm:<30} {_fmt_us(statistics.median(ms))} "
                f"[{min(ms) / 1000:.2f}-{max(ms) / 1000:.2f}]  x{ratio:.2f}"
            )


def _fmt_us(ns: float) -> str:
    return f"{ns / 1000:8.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=1000)
    parser.add_argument("--sizes", default="1000,10000,100000,1000000")
    parser.add_argument("--memory-sizes", default="100000,1000000")
    parser.add_argument("--rounds", type=int, default=1, help="rounds per cell (median shown)")
    parser.add_argument(
        "--dispatch-only", action="store_true", help="only the groups and slots comparison"
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    started = time.perf_counter()
    if args.dispatch_only:
        dispatch_table(sizes, args.ops, max(1, args.rounds))
        print(f"total {time.perf_counter() - started:.1f}s")
        return

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
    dispatch_table(sizes, args.ops, max(1, args.rounds))
    print(f"total {time.perf_counter() - started:.1f}s")


if __name__ == "__main__":
    main()
