"""Benchmark of tools/replay: one simulation and a 16-point sweep of a large trace.
Prints figures, asserts nothing.

    python -m bench.replay_bench [--requests 1000000] [--jobs N] [--repeat 1] [--no-sweep]
    python -m bench.replay_bench --patience-check
    python -m bench.replay_bench --parts [--requests 200000]

The trace is the film scenario (tools/replay/generate.py) repeated day after day and
cut at `--requests`, built in memory: writing a million requests (about six million
events) to SQLite and extracting them again would time the store, not the replay
(`generate --days` and `extract` are timed on a smaller log at the end instead).

- one run: `simulate()` of the whole trace on the server's own core (apply + decide
  with its counterfactuals, so reorders are counted), under the default parameters and
  with every term on (fair share and short job too, expected run times learnt from
  the run's own completions as the server learns them);
- sweep: aging=30,60 x bonus=0,10 x fair=0,10 x short=0,10 through `run_policies` on
  `--jobs` worker processes, including each run's figures (per band, caller, model,
  chain).

`--parts` prints, instead, where one run's time goes: the core's `choose` and each
event type's fold, timed by wrapping them, and the rest (the simulator's own loop).

`--patience-check` prints, instead, how many clients give up on the film scenario
(seeds 1-3) in a re-run with every client's true patience (the generator knows it)
against what the replay's patience models say from the log alone (auto, none).

Wall time is what the targets are about (< 12 s one run with every term on, < 100 s
sweep on the 2-core dev machine); CPU time is printed too because a busy machine
inflates wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from pathlib import Path
from unittest import mock

from app.core import events as ev
from app.core.policy import Choice, choose
from app.core.scoring import NS_PER_S, ScoringParams
from app.core.state import SchedulerState, apply
from tools.replay import simulate as simulate_module
from tools.replay.generate import film, generate_events, write_log
from tools.replay.patience import PatienceModel, with_patience
from tools.replay.simulate import Policy, simulate
from tools.replay.sweep import label_of, parse_grid, run_policies
from tools.replay.workload import Request, extract, extract_events

REQUESTS_PER_DAY = 520  # about: the film scenario's working day


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeat", type=int, default=1, help="one-run repetitions (best is shown)")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--store-days", type=int, default=20, help="days for the SQLite round trip")
    ap.add_argument("--patience-check", action="store_true", help="the patience models' error")
    ap.add_argument("--parts", action="store_true", help="where one run's time goes, by step")
    args = ap.parse_args()
    if args.patience_check:
        patience_check()
        return
    if args.parts:
        parts(args.requests)
        return

    print(f"cpus: {os.cpu_count()}, jobs: {args.jobs}")
    t = time.perf_counter()
    days = args.requests // REQUESTS_PER_DAY + 2
    workload = film(1, days=days, limit=args.requests).workload
    built = time.perf_counter() - t
    print(f"trace: {len(workload.requests):,} requests ({days} film days) built in {built:.1f} s")

    every_term = ScoringParams(60 * NS_PER_S, 10, fair_share_bonus=10, short_job_bonus=10)
    for policy in (Policy("default", ScoringParams()), Policy("every term", every_term)):
        best_wall = best_cpu = float("inf")
        for _ in range(args.repeat):
            w0, c0 = time.perf_counter(), time.process_time()
            result = simulate(workload, policy)
            best_wall = min(best_wall, time.perf_counter() - w0)
            best_cpu = min(best_cpu, time.process_time() - c0)
        per_req = best_wall / len(workload.requests) * 1e6
        print(
            f"one run ({label_of(policy.params)}): {best_wall:.2f} s wall, {best_cpu:.2f} s "
            f"cpu ({per_req:.1f} us/request); {len(result.order):,} dispatches, "
            f"{result.swaps:,} swaps, reorders {result.reorders}, simulated span "
            f"{(result.last_ns - result.first_ns) / NS_PER_S / 86400:.0f} days"
        )

    if not args.no_sweep:
        grid = parse_grid(["aging=30,60", "bonus=0,10", "fair=0,10", "short=0,10"], ScoringParams())
        policies = [Policy(label_of(p), p) for p in grid]
        w0 = time.perf_counter()
        before = os.times()
        rows = run_policies(workload, policies, jobs=args.jobs)
        after = os.times()
        wall = time.perf_counter() - w0
        cpu = sum(after[:4]) - sum(before[:4])  # user, system, children's user and system
        best = min(rows, key=lambda r: r["bands"]["interactive"]["wait_p95_s"] or 0)
        print(
            f"sweep of {len(policies)} points on {args.jobs} workers: {wall:.1f} s wall, "
            f"{cpu:.1f} s cpu (incl. figures); lowest interactive p95: {best['label']}"
        )

    # The store round trip, on a smaller log: generate -> SQLite -> extract.
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "film.db"
        small = film(1, days=args.store_days)
        t = time.perf_counter()
        events = generate_events(small, ScoringParams())
        write_log(db, events)
        t_write = time.perf_counter() - t
        t = time.perf_counter()
        extracted = extract(db)
        t_read = time.perf_counter() - t
        n = len(small.workload.requests)
        print(
            f"store round trip ({args.store_days} days, {n:,} requests, {len(events):,} events): "
            f"generate+write {t_write:.1f} s ({t_write / n * 1e6:.0f} us/request), "
            f"extract {t_read:.1f} s ({t_read / n * 1e6:.0f} us/request); "
            f"{len(extracted.requests):,} requests read back"
        )


def patience_check() -> None:
    """Clients lost per policy: true patience vs the models, from the same log."""
    policies = [
        Policy("recorded (60s, 10)", ScoringParams()),
        Policy("short=20", ScoringParams(short_job_bonus=20)),
        Policy("priority, no aging", ScoringParams(0, 10)),
        Policy("arrival order", ScoringParams(0, 0), ignore_priority=True),
    ]
    print("clients who give up: true patience / --patience auto / --patience none")
    for seed in (1, 2, 3):
        scenario = film(seed)
        logged = extract_events(enumerate(generate_events(scenario, ScoringParams()), 1))
        truth = {r.request_id: r.patience_ns for r in scenario.workload.requests}
        true_w = dataclasses.replace(
            logged,
            requests=[_with_patience_ns(r, truth[r.request_id]) for r in logged.requests],
        )
        auto_w = with_patience(logged, PatienceModel())
        recorded = sum(1 for t in (logged.recorded.start_ns if logged.recorded else []) if t < 0)
        cells = []
        for policy in policies:
            counts = [
                sum(1 for t in simulate(w, policy).start_ns if t < 0)
                for w in (true_w, auto_w, logged)
            ]
            cells.append(f"{policy.label} {'/'.join(map(str, counts))}")
        print(f"film seed {seed} (recorded {recorded}): " + "; ".join(cells))


def parts(requests: int) -> None:
    """One run of `requests` film requests per parameter set, with the simulator's
    `apply` and `choose` wrapped to time each: what the core costs per request, by
    event folded, against the whole run (the wrapper adds its own call to each)."""
    workload = film(1, days=requests // REQUESTS_PER_DAY + 2, limit=requests).workload
    spent: dict[str, float] = {}
    clock = time.perf_counter

    def timed_apply(state: SchedulerState, event: ev.AnyEvent) -> None:
        t = clock()
        apply(state, event)
        name = f"fold {ev.type_name(event)}"
        spent[name] = spent.get(name, 0.0) + clock() - t

    def timed_choose(state: SchedulerState, now_ns: int) -> Choice | None:
        t = clock()
        found = choose(state, now_ns)
        spent["choose"] = spent.get("choose", 0.0) + clock() - t
        return found

    every_term = ScoringParams(60 * NS_PER_S, 10, fair_share_bonus=10, short_job_bonus=10)
    # The simulator's own names for the core's functions, swapped for timed ones.
    with (
        mock.patch.object(simulate_module, "apply", timed_apply),
        mock.patch.object(simulate_module, "fold_for", lambda event_type: timed_apply),
        mock.patch.object(simulate_module, "choose", timed_choose),
    ):
        for policy in (Policy("default", ScoringParams()), Policy("every term", every_term)):
            spent.clear()
            t = clock()
            simulate(workload, policy)
            total = clock() - t
            per = 1e6 / len(workload.requests)
            print(f"{policy.label}: {total * per:.1f} us per request in all")
            for name, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
                print(f"  {name:>28}: {seconds * per:6.2f} us")
            rest = (total - sum(spent.values())) * per
            print(f"  {'the rest (simulator loop)':>28}: {rest:6.2f} us")


def _with_patience_ns(r: Request, patience_ns: int | None) -> Request:
    return dataclasses.replace(r, patience_ns=patience_ns)


if __name__ == "__main__":
    main()
