"""Command line: `python -m tools.replay ...`, also `gpulane replay ...` (`replay_command`).

    replay DB [--verify] [--aging-divisor S] [--swap-affinity-bonus N]
              [--fair-share-bonus N] [--short-job-bonus N]
              [--sweep aging=0,30,60,120 bonus=0,5,10,20 fair=0,20 short=0,20]
              [--shake N [--noise F] [--seed N]] [--patience auto|none|BAND=DUR,...]
              [--json | --csv] [--by caller,model] [--plot FILE.png] [--jobs N]
              [--fifo-concurrency N] [--chain-gap S] [--no-reference]
              [--config OTHER.yaml ...] [--slot-slowdown F]
    replay DB --what-if sleep=MODEL[,MODEL] [--costs MODEL=sleep:S,wake:S[,start:S,stop:S] ...]
              [--json]
    replay generate SCENARIO --out DB [--seed N] [--days N] [--aging-divisor S]
              [--swap-affinity-bonus N] [--fair-share-bonus N] [--short-job-bonus N]
              [--force]
    replay truth SCENARIO [--seeds 1,2,3] [--grid fair=0,20 short=0,20]
              [--patience auto|none|BAND=DUR,...] [--days N] [--shake N] [--noise F]
              [--no-reference] [--fifo-concurrency N] [--config OTHER.yaml ...] [--json]

Exit status: 0 ok, 1 a failed --verify or an unusable database, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from app.core.scoring import ScoringParams
from app.core.state import SERIAL
from app.store.engine import DatabaseError, unusable
from tools.replay import report
from tools.replay.patience import (
    PatienceError,
    describe,
    parse_patience,
    summary,
    with_patience,
)
from tools.replay.resource_summary import resource_lines
from tools.replay.resources import (
    Resources,
    ResourcesError,
    load_resources,
    log_footprints,
    memory_resources,
)
from tools.replay.simulate import Policy, reference_policies, simulate
from tools.replay.sweep import (
    GridError,
    Shake,
    checked,
    label_of,
    parse_bonus,
    parse_grid,
    run_policies,
    seconds_to_ns,
)
from tools.replay.workload import DEFAULT_CHAIN_GAP_NS, SwapTimes, Workload, extract, iter_log

PROG = "gpulane replay"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Replay a gpulane log: verify its decisions, or re-run its workload under "
        "other agingDivisor / swapAffinityBonus / fairShareBonus / shortJobBonus values and "
        "compare. The database is opened read-only. `%(prog)s generate SCENARIO --out DB` "
        "writes a synthetic log instead.",
    )
    p.add_argument("db", help="gpulane SQLite database (read-only)")
    p.add_argument(
        "--verify",
        action="store_true",
        help="check that the core makes every recorded decision with the recorded parameters; "
        "print the first divergence and exit 1 if not",
    )
    p.add_argument("--aging-divisor", metavar="S", help="one run with this agingDivisor (seconds)")
    p.add_argument("--swap-affinity-bonus", metavar="N", help="one run with this bonus (0..99)")
    p.add_argument("--fair-share-bonus", metavar="N", help="one run with this fairShareBonus")
    p.add_argument("--short-job-bonus", metavar="N", help="one run with this shortJobBonus")
    p.add_argument(
        "--sweep",
        nargs="+",
        metavar="AXIS=V,...",
        help="a grid: aging=0,30,60,120 bonus=0,5,10,20 fair=0,10,20 short=0,10,20 "
        "(seconds, points; bonus + fair + short + tier span 2 <= 99)",
    )
    p.add_argument(
        "--patience",
        default="auto",
        metavar="MODEL",
        help="how long a client served in the recorded run waits in a what-if run: auto "
        "(drawn from a Kaplan-Meier estimate of its band and model's patience, past its "
        "recorded wait; a band and model with no leavers stays; default), none (forever), or "
        "interactive=10m,normal=30m,batch=none; never less than its recorded wait. "
        "Recorded leavers leave at their recorded patience, deadlines hold, durable jobs stay",
    )
    p.add_argument(
        "--by",
        default="",
        metavar="caller,model",
        help="table: add waits per caller (with first start, last finish) and/or per model",
    )
    p.add_argument(
        "--shake",
        type=int,
        default=0,
        metavar="N",
        help="N perturbed re-runs: each figure's spread and error (needed for *)",
    )
    p.add_argument(
        "--noise",
        type=float,
        default=0.05,
        metavar="F",
        help="shake: run times x (1 +/- F), arrivals +/- F x median gap (default 0.05); "
        "each shaken run also draws again patience, swap times and the run times of requests "
        "that never ran",
    )
    p.add_argument("--seed", type=int, default=0, help="shake seed (default 0)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="JSON instead of a table")
    out.add_argument("--csv", action="store_true", help="CSV (one line per run) instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="wait distributions and GPU timelines")
    p.add_argument(
        "--jobs", type=int, default=None, metavar="N", help="worker processes (default: cores)"
    )
    p.add_argument(
        "--fifo-concurrency",
        type=int,
        default=10,
        metavar="N",
        help="requests in flight per model in the fifo reference row (default 10, llama-swap's)",
    )
    p.add_argument(
        "--chain-gap",
        type=float,
        default=DEFAULT_CHAIN_GAP_NS / 1e9,
        metavar="S",
        help="for a log that names no chain (X-Gpulane-Chain), a guess: a caller's request "
        "sent within S seconds of its previous one's end is sent after it in every run, in "
        "chains of 3 requests at least (default 5; 0: arrivals are fixed). A log that names "
        "its chains is replayed with them, and this is not used",
    )
    p.add_argument("--no-reference", action="store_true", help="omit the reference policies")
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="OTHER.yaml",
        help="what-if resources: also run each parameter set on this config's router and "
        "slots (concurrencyLimit), e.g. a second GPU group or four chat slots; repeatable",
    )
    p.add_argument(
        "--memory-budget",
        action="append",
        default=[],
        metavar="SIZE",
        help="what-if resources: also run each parameter set under the memory router with "
        "this budget (e.g. 141GB), models sized by the footprints the log recorded (or "
        "declared); repeatable",
    )
    p.add_argument(
        "--slot-slowdown",
        type=float,
        default=0.0,
        metavar="F",
        help="a request that starts beside k others on its model runs x (1 + F x k) in the "
        "--config runs (default 0: its recorded run time, unaffected by its neighbours)",
    )
    p.add_argument(
        "--what-if",
        metavar="sleep=MODEL,...",
        help="what if these models slept instead of stopping: the recorded parameters and "
        "arrival order, each with stop and cold start and with sleep, side by side "
        "(interactive waits, swaps, the lane's busy share)",
    )
    p.add_argument(
        "--costs",
        action="append",
        default=[],
        metavar="MODEL=sleep:S,wake:S",
        help="with --what-if: a model's swap costs in seconds (sleep, wake, start, stop), "
        "instead of the log's; repeatable",
    )
    return p


def build_generate_parser() -> argparse.ArgumentParser:
    from tools.replay.generate import SCENARIOS

    p = argparse.ArgumentParser(
        prog=f"{PROG} generate",
        description="Write a synthetic log (same schema as the server's) by running a scenario "
        "through the core's simulation.",
    )
    p.add_argument("scenario", choices=sorted(SCENARIOS), help="workload to generate")
    p.add_argument("--out", required=True, metavar="DB", help="database to create")
    p.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    p.add_argument("--days", type=int, default=1, help="working days to generate (default 1)")
    p.add_argument(
        "--aging-divisor", default="60", metavar="S", help="recorded agingDivisor (default 60)"
    )
    p.add_argument(
        "--swap-affinity-bonus", default="10", metavar="N", help="recorded bonus (default 10)"
    )
    p.add_argument(
        "--fair-share-bonus", default="0", metavar="N", help="recorded fairShareBonus (default 0)"
    )
    p.add_argument(
        "--short-job-bonus", default="0", metavar="N", help="recorded shortJobBonus (default 0)"
    )
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    return p


def replay_command(argv: Sequence[str] | None = None) -> int:
    """Entry point for `gpulane replay ...` and `python -m tools.replay ...`."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "generate":
        return _generate(build_generate_parser(), args_list[1:])
    if args_list and args_list[0] == "truth":
        from tools.replay.truth import build_truth_parser

        return _truth(build_truth_parser(PROG), args_list[1:])
    parser = build_parser()
    args = parser.parse_args(args_list)
    try:
        if args.verify:
            return _verify(args.db)
        if args.what_if:
            return _what_if(args)
        if args.costs:
            parser.error("--costs goes with --what-if")
        return _report(parser, args)
    except DatabaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        # A page found damaged while the log is read, past the check on opening.
        problem = unusable(args.db, exc)
        if problem is None:
            raise
        print(f"error: {problem}", file=sys.stderr)
        return 1


def _what_if(args: argparse.Namespace) -> int:
    from tools.replay import sleep_whatif as w

    workload = extract(args.db, chain_gap_ns=round(args.chain_gap * 1e9))
    try:
        sleepers = w.parse_what_if(args.what_if, workload.models)
        given = w.parse_costs(args.costs)
    except w.WhatIfError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    costs = w.learnt_costs((e for _, e in iter_log(args.db)), given)
    for model in sleepers:
        known = costs.get(model)
        if known is None or known.sleep_ns is None or known.wake_ns is None:
            print(
                f"error: the log has no sleep and wake of {model}: give them "
                f"(--costs {model}=sleep:S,wake:S)",
                file=sys.stderr,
            )
            return 2
    rows = w.compare(workload, sleepers, costs)
    if args.json:
        print(w.to_json(rows, costs))
        return 0
    header = (
        f"{args.db}: {len(workload.requests)} requests, models {', '.join(workload.models)}; "
        f"what if {', '.join(sleepers)} slept instead of stopping"
    )
    print(w.table(rows, header) + "\n" + w.costs_lines(costs, workload.models), end="")
    return 0


def _verify(db: str) -> int:
    from tools.replay.verify import verify

    result = verify(iter_log(db))
    if result.divergence is not None:
        print(result.divergence.describe())
        print(f"failed: {db}: decision {result.decisions} differs from the core's")
        return 1
    print(f"ok: {result.decisions} decisions in {result.events} events match the core")
    return 0


def _report(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.shake < 0 or args.fifo_concurrency < 1 or (args.jobs is not None and args.jobs < 1):
        parser.error("--shake must be >= 0, --fifo-concurrency and --jobs >= 1")
    if args.chain_gap < 0 or not 0 <= args.noise < 1:
        parser.error("--chain-gap must be >= 0 and --noise in [0, 1)")
    if args.slot_slowdown < 0:
        parser.error("--slot-slowdown must be >= 0")
    by = [b.strip() for b in args.by.split(",") if b.strip()]
    if any(b not in ("caller", "model") for b in by):
        parser.error(f"--by {args.by!r}: expected caller, model or caller,model")
    try:
        _policies(Workload([], SwapTimes(), ScoringParams()), args)  # arguments first
        patience = parse_patience(args.patience)
    except (GridError, PatienceError) as exc:
        parser.error(str(exc))
    t0 = time.perf_counter()
    extracted = extract(args.db, chain_gap_ns=round(args.chain_gap * 1e9))
    workload = with_patience(extracted, patience)
    try:
        resources = [load_resources(path, workload.models) for path in args.config]
        if args.memory_budget:
            sizes = log_footprints(args.db)
            resources += [
                memory_resources(budget, sizes, workload.router, workload.models)
                for budget in args.memory_budget
            ]
    except ResourcesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    policies = _policies(workload, args, resources)
    shake = Shake(args.shake, args.noise, args.seed, patience)
    rows = run_policies(workload, policies, jobs=args.jobs, shake=shake, quantiles=bool(args.plot))
    recorded = workload.recorded
    assert recorded is not None
    first = report.figures(
        workload,
        recorded,
        label="recorded",
        kind="recorded",
        params=workload.params,
        scheduler=workload.scheduler,
        quantiles=bool(args.plot),
    )
    rows = [first, *rows]
    # The baseline is the simulated run of what the log ran: a fifo log's is the
    # fifo reference row (the grid's sets are serial).
    baseline = (
        _baseline_label(workload.params)
        if workload.scheduler == SERIAL
        else f"fifo (x{args.fifo_concurrency})"
    )
    error = report.judge(rows, baseline)
    best = next((r for r in rows if r["best"]), None)
    meta = {
        "database": str(args.db),
        "requests": len(workload.requests),
        "models": workload.models,
        "recorded": {
            "scheduler": workload.scheduler,
            "aging_divisor_s": workload.params.aging_divisor_ns / 1e9,
            "swap_affinity_bonus": workload.params.swap_affinity_bonus,
            "fair_share_bonus": workload.params.fair_share_bonus,
            "short_job_bonus": workload.params.short_job_bonus,
            "caller_weights": workload.caller_weights,
            "expected_run_times": workload.expected_recorded,
        },
        "patience": summary(extracted, patience) if patience.auto else None,
        "simulation_error": error,
        "swap_times_s": {
            m: {
                "load": workload.swap_times.load_ns.get(m, workload.swap_times.default_load_ns)
                / 1e9,
                "unload": workload.swap_times.unload_ns.get(
                    m, workload.swap_times.default_unload_ns
                )
                / 1e9,
            }
            for m in workload.models
        },
        "chained": sum(1 for r in workload.requests if r.after >= 0),
        "chains": "recorded (X-Gpulane-Chain)"
        if workload.chains_recorded
        else "guessed from timing: no event names a request's predecessor",
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if args.plot:
        _plot(args.plot, workload, rows, policies, best)
    for row in rows:
        row.pop("quantiles", None)
    if args.json:
        print(report.to_json(rows, meta))
    elif args.csv:
        print(report.to_csv(rows), end="")
    else:
        header = (
            f"{args.db}: {meta['requests']} requests, models {', '.join(workload.models)}; "
            f"recorded {workload.scheduler}, {label_of(workload.params)}"
            + (f"; spread over {args.shake} shaken runs (noise {args.noise})" if args.shake else "")
            + f"\npatience of served clients: {describe(extracted, patience)}"
        )
        print(
            report.table(rows, header, error=error, by=by, guessed=not workload.chains_recorded),
            end="",
        )
        changed = resource_lines(rows, [what.label for what in resources])
        if changed:
            print("\nwhat-if resources (swaps avoided, lane busy share):\n" + changed, end="")
    return 0


def _baseline_label(recorded: ScoringParams) -> str:
    return label_of(recorded) + " (recorded)"


def _policies(
    workload: Workload, args: argparse.Namespace, resources: Sequence[Resources] = ()
) -> list[Policy]:
    """The parameter sets on the recorded resources, then each on every `--config`'s
    (labelled `... on OTHER.yaml`), then the reference policies."""
    recorded = workload.params
    singles = (
        args.aging_divisor,
        args.swap_affinity_bonus,
        args.fair_share_bonus,
        args.short_job_bonus,
    )
    if args.sweep:
        grid = parse_grid(args.sweep, recorded)
        if any(v is not None for v in singles):
            raise GridError(
                "--sweep does not combine with --aging-divisor, --swap-affinity-bonus, "
                "--fair-share-bonus or --short-job-bonus"
            )
    else:
        grid = [_single(recorded, args)]
    if recorded not in grid:
        grid = [recorded, *grid]
    weights = tuple(sorted(workload.caller_weights.items()))
    recorded_slots = tuple(sorted(workload.slots.items()))
    policies = [
        Policy(
            _baseline_label(p) if p == recorded else label_of(p),
            p,
            caller_weights=weights,
            router=workload.router,
            slots=recorded_slots,
        )
        for p in grid
    ]
    for what in resources:
        policies += [
            replace(
                base,
                label=f"{label_of(base.params)} on {what.label}",
                router=what.router,
                slots=what.slots,
                slot_slowdown=args.slot_slowdown,
            )
            for base in policies[: len(grid)]
        ]
    if not args.no_reference:
        policies += reference_policies(workload, recorded, args.fifo_concurrency)
    return policies


def _plot(
    path: str,
    workload: Workload,
    rows: list[report.Figures],
    policies: list[Policy],
    best: report.Figures | None,
) -> None:
    from tools.replay.plot import PlotUnavailable, plot

    recorded = workload.recorded
    timelines = [("recorded", recorded.timeline or [] if recorded else [])]
    if best is not None:
        policy = next(p for p in policies if p.label == best["label"])
        result = simulate(workload, policy, timeline=True)
        timelines.append((f"best: {best['label']}", result.timeline or []))
    try:
        plot(path, rows, timelines)
    except PlotUnavailable as exc:
        print(f"warning: {exc}", file=sys.stderr)


def _single(base: ScoringParams, args: argparse.Namespace) -> ScoringParams:
    """`base` with whichever of the single-run options are given."""

    def points(text: str | None, name: str, default: int) -> int:
        return default if text is None else parse_bonus(text, name)

    return checked(
        ScoringParams(
            base.aging_divisor_ns
            if args.aging_divisor is None
            else seconds_to_ns(args.aging_divisor),
            points(args.swap_affinity_bonus, "bonus", base.swap_affinity_bonus),
            points(args.fair_share_bonus, "fair-share bonus", base.fair_share_bonus),
            points(args.short_job_bonus, "short-job bonus", base.short_job_bonus),
        )
    )


def _generate(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    from tools.replay.generate import SCENARIOS, generate_events, write_log

    args = parser.parse_args(argv)
    try:
        params = _single(ScoringParams(), args)
    except GridError as exc:
        parser.error(str(exc))
    if args.days < 1:
        parser.error("--days must be >= 1")
    out = Path(args.out)
    if out.exists():
        if not args.force:
            print(f"error: {out} exists (use --force to replace it)", file=sys.stderr)
            return 1
        for suffix in ("", "-wal", "-shm"):
            Path(f"{out}{suffix}").unlink(missing_ok=True)
    t0 = time.perf_counter()
    scenario = SCENARIOS[args.scenario](args.seed, days=args.days)
    events = generate_events(scenario, params, label=f"{args.scenario}-seed{args.seed}")
    try:
        write_log(out, events)
    except DatabaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"ok: {out}: {len(scenario.workload.requests)} requests, {len(events)} events "
        f"({args.scenario}, seed {args.seed}, {label_of(params)}) in "
        f"{time.perf_counter() - t0:.1f}s"
    )
    return 0


def _truth(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    from tools.replay import truth

    args = parser.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: expected integers, e.g. 1,2,3")
    if not seeds or args.days < 1:
        parser.error("--seeds needs one seed at least and --days must be >= 1")
    try:
        grid = parse_grid(args.grid, ScoringParams())
        patience = parse_patience(args.patience)
    except (GridError, PatienceError) as exc:
        parser.error(str(exc))
    t0 = time.perf_counter()
    if args.shake < 0 or not 0 <= args.noise < 1:
        parser.error("--shake must be >= 0 and --noise in [0, 1)")
    if args.fifo_concurrency < 1:
        parser.error("--fifo-concurrency must be >= 1")
    from tools.replay.generate import SCENARIOS

    models = SCENARIOS[args.scenario](seeds[0], days=args.days).workload.models
    try:
        resources = [load_resources(path, models) for path in args.config]
    except ResourcesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    comparisons = truth.check(
        args.scenario,
        seeds,
        grid,
        patience=patience,
        days=args.days,
        shake=args.shake,
        noise=args.noise,
        references=not args.no_reference,
        fifo_concurrency=args.fifo_concurrency,
        resources=resources,
    )
    if args.json:
        print(truth.to_json(comparisons))
    else:
        print(truth.table(comparisons), end="")
        refs = "" if args.no_reference else " and the reference policies"
        print(f"\n{len(seeds)} seeds x {len(grid)} points{refs} in {time.perf_counter() - t0:.1f}s")
    return 0
