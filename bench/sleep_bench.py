"""Sleep instead of stop: interactive chats beside a batch run, and the lane's busy share.
Prints figures; asserts nothing.

    .venv/bin/python -m bench.sleep_bench [--cold 20] [--sleep 0.5] [--wake 1] [--json]

The mix of issue 43, replayed on the server's own core (`tools.replay.simulate`:
every decision is `app.core.policy.decide`'s, every swap costs what the fake
servers of tools/fake_sleeper.py were told to take):

- a batch model: 20 jobs of 30 s (priority batch), all queued at the start;
- a chat model: a 1 s interactive chat every 20 s for 10 minutes (30 chats,
  the first at 10 s);
- a cold start costs `--cold` (20 s), a sleep `--sleep` (0.5 s), a wake `--wake`
  (1 s); a stop is free (the fake exits at once).

Four runs side by side: the score (the default agingDivisor 60 s and
swapAffinityBonus 10) with stop and cold start (what gpulane did before), the
score with both models sleeping, arrival order with cold swaps (llama-swap's
order), arrival order with sleep. For each: the interactive chats' time to start
(arrival to the start of their run, their own swap included), the swaps, the
lane's busy share (time running requests over the first arrival to the last
end) and the makespan. Then, for the score with sleep, each chat's time to start
against its bound: the rest of the job running when it arrived, one sleep, one
wake (the first chat: its cold start instead) and the chats ahead of it. Targets
(issue 43): every chat within its bound; the busy share with sleep at least
0.85x arrival order's.
"""

from __future__ import annotations

import argparse
import json
import sys

from app.core.scoring import ScoringParams
from app.core.swap_costs import ActionCosts
from tools.replay.simulate import Policy, SwapCost, reference_policies, simulate
from tools.replay.sleep_whatif import Figures, figures, sleeping_cost
from tools.replay.workload import Request, RunResult, SwapTimes, Workload

S = 1_000_000_000
BATCH, CHAT = "batch-model", "chat-model"
JOBS, JOB_S = 20, 30
CHAT_EVERY_S, CHAT_RUN_S, ARRIVALS_S = 20, 1, 600


def workload(cold_s: float) -> Workload:
    requests = [
        Request(f"job-{i:02d}", BATCH, -100, 0, JOB_S * S, durable=True, caller="nightly")
        for i in range(JOBS)
    ]
    requests += [
        Request(f"chat-{k:02d}", CHAT, 100, t * S, CHAT_RUN_S * S, caller="alice")
        for k, t in enumerate(range(CHAT_EVERY_S // 2, ARRIVALS_S, CHAT_EVERY_S))
    ]
    requests.sort(key=lambda r: r.arrival_ns)
    cold = round(cold_s * S)
    times = SwapTimes(load_ns={BATCH: cold, CHAT: cold}, unload_ns={BATCH: 0, CHAT: 0})
    return Workload(requests=requests, swap_times=times, params=ScoringParams())


def bounds(
    w: Workload, result: RunResult, sleep_ns: int, wake_ns: int
) -> list[tuple[str, float, float | None]]:
    """(chat, its time to start, its bound) in arrival order, for a run with sleep.
    The bound: the rest of the batch job holding the lane when it arrived (from
    that job's dispatch, its swap included), one sleep, one wake and the runs of
    the chats ahead of it. None: the chat arrived before the chat model's first
    load ended (the first load aside: it waits for cold starts, not wakes)."""
    out: list[tuple[str, float, float | None]] = []
    held = [
        (result.arrival_ns[i] + result.wait_ns[i], result.end_ns[i])
        for i, r in enumerate(w.requests)
        if r.model == BATCH and result.start_ns[i] >= 0
    ]
    chats = [i for i, r in enumerate(w.requests) if r.model == CHAT and result.start_ns[i] >= 0]
    first_ready = min((result.start_ns[i] for i in chats), default=0)
    for i in chats:
        arrival = result.arrival_ns[i]
        took = (result.start_ns[i] - arrival) / S
        if arrival < first_ready:
            out.append((w.requests[i].request_id, took, None))
            continue
        rest = max((end - arrival for since, end in held if since <= arrival < end), default=0)
        ahead = sum(
            w.requests[j].run_ns
            for j in chats
            if j != i and result.arrival_ns[j] <= arrival < result.start_ns[j]
        )
        bound = (rest + sleep_ns + wake_ns + ahead) / S
        out.append((w.requests[i].request_id, took, bound))
    return out


def live(scale: float, cold_s: float, sleep_s: float, wake_s: float) -> int:
    """The same mix through `gpulane serve` and tools/fake_sleeper.py processes, every
    time scaled by `scale` (0.1: a 3 s job, a 2 s cold start), by the GPU bench's
    harness (bench/gpu_bench.py --dry-run)."""
    import tempfile
    from pathlib import Path

    from bench import gpu_bench

    step = gpu_bench.DRY_STEP_S
    args = argparse.Namespace(
        dry_run=True,
        gib=1.0,
        jobs=JOBS,
        job_steps=round(JOB_S * scale / step),
        chat_steps=max(1, round(CHAT_RUN_S * scale / step)),
        chat_every=CHAT_EVERY_S * scale,
        chat_offset=CHAT_EVERY_S * scale / 2,
        span=ARRIVALS_S * scale,
        fake=(cold_s * scale, sleep_s * scale, wake_s * scale),
    )
    print(
        f"live, every time x{scale:g}: {JOBS} jobs of {JOB_S * scale:g} s, a "
        f"{CHAT_RUN_S * scale:g} s chat every {CHAT_EVERY_S * scale:g} s for "
        f"{ARRIVALS_S * scale:g} s; cold start {cold_s * scale:g} s, sleep {sleep_s * scale:g} s, "
        f"wake {wake_s * scale:g} s (tools/fake_sleeper.py behind gpulane serve)\n"
    )
    rows = {}
    with tempfile.TemporaryDirectory(prefix="gpulane-sleep-bench-") as tmp:
        for arm in ("score", "sleep", "arrival"):
            rows[arm] = gpu_bench.run_arm(arm, args, Path(tmp))
    print(f"{'run':<26} {'chat start p50':>14} {'max':>6} {'swaps':>5} {'busy':>6} {'makespan':>9}")
    for arm, label in (
        ("score", "score, cold swaps"),
        ("sleep", "score, sleep"),
        ("arrival", "arrival order, cold swaps"),
    ):
        r = rows[arm]
        starts = [took for took, _ in _live_chats(r["events"], 0, 0, 0, gpu_bench.B)]
        print(
            f"{label:<26} {_q(starts, 0.5):>13.2f}s {max(starts, default=0):>5.2f}s "
            f"{r['swaps']:>5} {r['gpu_busy']:>6.1%} {r['makespan_s']:>8.1f}s"
        )
    share = rows["sleep"]["gpu_busy"] / rows["arrival"]["gpu_busy"]
    cold = rows["score"]["gpu_busy"] / rows["arrival"]["gpu_busy"]
    print(
        f"\nbusy share vs arrival order's: score with sleep {share:.2f}x, "
        f"score with cold swaps {cold:.2f}x (target with sleep: >= 0.85x)"
    )
    chats = _live_chats(
        rows["sleep"]["events"],
        round(sleep_s * scale * S),
        round(wake_s * scale * S),
        round(CHAT_RUN_S * scale * S),
        gpu_bench.B,
    )
    judged = [(t, b) for t, b in chats if b is not None]
    past = [t - b for t, b in judged]
    within = sum(1 for x in past if x <= 0)
    print(
        f"\nscore with sleep: {within}/{len(judged)} chats within their bound (the first load "
        f"aside); time to start minus bound: median {_q(past, 0.5) * 1000:+.0f} ms, "
        f"max {max(past, default=0) * 1000:+.0f} ms (the bound leaves out gpulane's own time "
        "per swap: the calls, the check, the dispatch)"
    )
    return 0


_TIMES = ("request_enqueued", "request_dispatched", "request_started", "request_completed")


def _live_chats(
    events: list[tuple[str, dict[str, object]]],
    sleep_ns: int,
    wake_ns: int,
    run_ns: int,
    chat_model: str,
) -> list[tuple[float, float | None]]:
    """(time to start, bound) of each chat of a live run, from gpulane's events (as
    `bounds`: None for a chat before the chat model's first load ended)."""
    at: dict[str, dict[str, int]] = {}
    for kind, d in events:
        rid = str(d.get("request_id", ""))
        if kind in (
            "request_enqueued",
            "request_dispatched",
            "request_started",
            "request_completed",
        ):
            at.setdefault(rid, {})[kind] = int(d["at"])  # type: ignore[call-overload]
            if kind == "request_enqueued":
                at[rid]["chat"] = int(d["model"] == chat_model)
    chats = sorted(
        (v for v in at.values() if v.get("chat") and "request_started" in v),
        key=lambda v: v["request_enqueued"],
    )
    jobs = [v for v in at.values() if not v.get("chat") and "request_completed" in v]
    first_ready = min((v["request_started"] for v in chats), default=0)
    out: list[tuple[float, float | None]] = []
    for v in chats:
        arrival = v["request_enqueued"]
        took = (v["request_started"] - arrival) / S
        if arrival < first_ready:
            out.append((took, None))
            continue
        rest = max(
            (
                j["request_completed"] - arrival
                for j in jobs
                if j["request_dispatched"] <= arrival < j["request_completed"]
            ),
            default=0,
        )
        ahead = sum(
            run_ns
            for o in chats
            if o is not v and o["request_enqueued"] <= arrival < o["request_started"]
        )
        out.append((took, (rest + sleep_ns + wake_ns + ahead) / S))
    return out


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))] if ordered else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sleep_bench", description=__doc__)
    p.add_argument("--cold", type=float, default=20.0, help="cold start, seconds (default 20)")
    p.add_argument("--sleep", type=float, default=0.5, help="sleep, seconds (default 0.5)")
    p.add_argument("--wake", type=float, default=1.0, help="wake, seconds (default 1)")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--live",
        type=float,
        metavar="SCALE",
        help="also run the mix live: gpulane serve and fake servers, every time x SCALE (0.1)",
    )
    args = p.parse_args(argv)
    w = workload(args.cold)
    sleep_ns, wake_ns, cold_ns = round(args.sleep * S), round(args.wake * S), round(args.cold * S)
    costs = {
        m: ActionCosts(start_ns=cold_ns, stop_ns=0, sleep_ns=sleep_ns, wake_ns=wake_ns)
        for m in (BATCH, CHAT)
    }
    score = Policy("score", ScoringParams())
    arrival = reference_policies(w, ScoringParams(), 1)[0]

    def run(policy: Policy, sleepers: tuple[str, ...]) -> tuple[Figures, RunResult]:
        cost: SwapCost = sleeping_cost(w.swap_times.cost, sleepers, costs)
        result = simulate(w, policy, swap_cost=cost)
        how = "sleep" if sleepers else "cold swaps"
        return figures(f"{policy.label}, {how}", w, result), result

    rows = [
        run(score, ()),
        run(score, (BATCH, CHAT)),
        run(arrival, ()),
        run(arrival, (BATCH, CHAT)),
    ]
    checked = bounds(w, rows[1][1], sleep_ns, wake_ns)
    share = rows[1][0].busy_share / rows[2][0].busy_share
    cold_share = rows[0][0].busy_share / rows[2][0].busy_share
    judged = [(took, bound) for _, took, bound in checked if bound is not None]
    within = sum(1 for took, bound in judged if took <= bound + 1e-9)
    if args.json:
        print(
            json.dumps(
                {
                    "runs": [f.__dict__ for f, _ in rows],
                    "chats": [{"id": c, "start_s": t, "bound_s": b} for c, t, b in checked],
                    "busy_vs_arrival_order": {"sleep": share, "cold_swaps": cold_share},
                },
                indent=2,
            )
        )
        return 0
    print(
        f"{JOBS} batch jobs of {JOB_S} s queued at 0; a {CHAT_RUN_S} s interactive chat every "
        f"{CHAT_EVERY_S} s for {ARRIVALS_S} s ({sum(1 for r in w.requests if r.model == CHAT)} "
        f"chats); cold start {args.cold:g} s, sleep {args.sleep:g} s, wake {args.wake:g} s\n"
    )
    print(
        f"{'run':<26} {'chat start p50':>14} {'p95':>6} {'max':>6} {'swaps':>5} "
        f"{'swap s':>7} {'busy':>6} {'makespan':>9}"
    )
    for f, _ in rows:
        print(
            f"{f.label:<26} {f.start_p50_s:>13.1f}s {_p95(w, _):>5.1f}s {f.start_max_s:>5.1f}s "
            f"{f.swaps:>5} {f.swap_s:>7.1f} {f.busy_share:>6.1%} {f.makespan_s:>8.0f}s"
        )
    print(
        f"\nbusy share vs arrival order's: score with sleep {share:.2f}x, "
        f"score with cold swaps {cold_share:.2f}x (target with sleep: >= 0.85x)"
    )
    print(
        f"\nscore with sleep, each chat's time to start against its bound "
        f"({within}/{len(judged)} within; the first load aside):"
    )
    for chat_id, took, limit in checked:
        if limit is None:
            print(f"  {chat_id}: {took:6.2f} s  (arrived before the chat model's first load ended)")
            continue
        mark = "ok" if took <= limit + 1e-9 else "OVER"
        print(f"  {chat_id}: {took:6.2f} s  bound {limit:6.2f} s  {mark}")
    if args.live:
        print()
        return live(args.live, args.cold, args.sleep, args.wake)
    return 0


def _p95(w: Workload, result: RunResult) -> float:
    starts = sorted(
        result.start_ns[i] - result.arrival_ns[i]
        for i, r in enumerate(w.requests)
        if r.model == CHAT and result.start_ns[i] >= 0
    )
    return starts[min(len(starts) - 1, int(0.95 * (len(starts) - 1) + 0.5))] / S if starts else 0.0


if __name__ == "__main__":
    sys.exit(main())
