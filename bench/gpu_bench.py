"""gpulane on a real GPU: the same arrivals by the score, in arrival order, with
sleep, and with the memory router when this gpulane has one. Prints figures;
asserts nothing. `make bench-gpu` (not part of `make test`).

    python3 -m bench.gpu_bench [--gib G] [--jobs 8] [--job-steps 150] [--chat-steps 10]
                               [--chat-every 4] [--span 40] [--arms score,arrival,sleep,memory]
                               [--out DIR] [--dry-run]

Needs an NVIDIA GPU and PyTorch (and gpulane's own dependencies); installs
nothing, since a GPU machine may have no network. Without a GPU it says so and
exits 0. Two model servers of the bench's own (bench/gpu_upstream.py) do real
GPU work: `--gib` GiB of bf16 weights each (default: 56 GiB, or less on a
smaller GPU or host: both may sleep, and a sleeper keeps its weights in pinned
host memory), `max_tokens` decode steps that each read every weight, vLLM's
sleep endpoints. gpulane serves them one at a time (no router: one model
resident), so each switch is a stop and a cold start, or with `sleep: vllm` a
sleep and a wake.

The arrivals of each arm: `--jobs` batch jobs of `--job-steps` decode steps on
model A, all queued at the start; an interactive chat of `--chat-steps` steps
on model B every `--chat-every` seconds for `--span` seconds. Arms: `score`
(the defaults: agingDivisor 60 s, swapAffinityBonus 10; stop and cold start),
`arrival` (bonus 0, aging off, no priorities: arrival order), `sleep` (the
score, both models `sleep: vllm`), `memory` (the score under
`routing.router.use: memory`; skipped when this gpulane's config has no such
router).

Printed per arm, from the servers' own logs (ground truth) and gpulane's
events: cold start, sleep and wake (the server's own time), gpulane's dispatch
gap (GPU idle between two requests of one model), swap overhead (GPU idle at a
switch beyond the server's own sleep, wake or cold start), the chats' latency
(sent to answered, at the client), the GPU's busy share (decode time over the
first arrival to the last answer) and the makespan.

`--dry-run` runs the same harness with tools/fake_sleeper.py for servers (no GPU,
no figures worth keeping): a check that the bench itself works.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ARMS = ("score", "arrival", "sleep", "memory")
A, B = "big-a", "big-b"
DRY_STEP_S = 0.01
"""--dry-run: seconds one decode step takes on the fake servers."""


def gpu() -> tuple[str, int, int] | None:
    """(name, GPU memory, host memory) in bytes, or None without an NVIDIA GPU and PyTorch."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return props.name, int(props.total_memory), int(host)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(
    arm: str,
    server: str,
    log: Path,
    start_port: int,
    gib: float,
    dry: bool,
    fake: tuple[float, float, float] = (1.0, 0.05, 0.1),
) -> str:
    """An arm's config; `fake`: the fake servers' cold start, sleep and wake (--dry-run)."""

    def model(name: str) -> str:
        if dry:
            cmd = (
                f"{sys.executable} -m tools.fake_sleeper --port ${{PORT}} --name {name} "
                f"--kind vllm --start-delay {fake[0]:g} --sleep-time {fake[1]:g} "
                f"--wake-time {fake[2]:g} --log {log}"
            )
        else:
            cmd = f"{sys.executable} {server} --port ${{PORT}} --gib {gib:g} --name {name}"
            cmd += f" --log {log}"
        entry = f"  {name}:\n    cmd: {cmd}\n"
        if arm == "sleep":
            entry += "    sleep: vllm\n"
        if arm == "memory":
            entry += f"    gpuMemory: {gib:g}GiB\n"
        return entry

    bonus, aging = (0, 0) if arm == "arrival" else (10, 60)
    lines = [
        f"startPort: {start_port}",
        "healthCheckTimeout: 300",
        "routing:",
        "  scheduler:",
        "    use: serial",
        "    settings:",
        "      serial:",
        f"        swapAffinityBonus: {bonus}",
        f"        agingDivisor: {aging}",
    ]
    if arm == "memory":
        # On a GPU the budget is the GPU's (auto, through NVML); a dry run has none.
        budget = f"{2 * gib + 1:g}GiB" if dry else "auto"
        lines += ["  router:", "    use: memory", "    settings:", "      memory:"]
        lines += [f"        budget: {budget}"]
    return "\n".join(lines) + "\nmodels:\n" + model(A) + model(B)


def memory_router_present(gib: float) -> bool:
    """Whether this gpulane's config takes `routing.router.use: memory`."""
    from app.config import ConfigError, parse_config

    text = config("memory", "x.py", Path("/dev/null"), 20000, gib, dry=True)
    try:
        parse_config(text, environ={})
    except ConfigError:
        return False
    return True


def run_arm(arm: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    log = tmp / f"{arm}-servers.jsonl"
    db = tmp / f"{arm}.db"
    cfg = tmp / f"{arm}.yaml"
    cfg.write_text(
        config(
            arm,
            str(REPO / "bench" / "gpu_upstream.py"),
            log,
            getattr(args, "start_port", 21000),
            args.gib,
            args.dry_run,
            getattr(args, "fake", (1.0, 0.05, 0.1)),
        )
    )
    import httpx  # gpulane's own dependency: not needed to say there is no GPU

    port = free_port()
    out = (tmp / f"{arm}-gpulane.log").open("wb")
    gateway = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--config", str(cfg)]
        + ["--listen", f"127.0.0.1:{port}", "--db", str(db)],
        cwd=REPO,
        stdout=out,
        stderr=subprocess.STDOUT,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).text == "OK":
                    break
            except httpx.HTTPError:
                pass
            if gateway.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gpulane did not start: see {out.name}")
            time.sleep(0.1)
        chats = traffic(url, arm, args)
    finally:
        gateway.send_signal(signal.SIGTERM)
        try:
            gateway.wait(60)
        except subprocess.TimeoutExpired:
            gateway.kill()
        out.close()
    return figures(arm, db, log, chats, args)


def traffic(url: str, arm: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Queue the batch jobs at once, then a chat every `chat_every` s; wait for all.
    Returns each request's client-side (sent, answered), by its tag."""
    import httpx

    client = httpx.Client(base_url=url, timeout=1800)
    sent_at: dict[str, dict[str, float]] = {}
    errors: list[str] = []

    def send(model: str, steps: int, tag: str, priority: str) -> tuple[float, float]:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": steps,
            "messages": [{"role": "user", "content": tag}],
        }
        if args.dry_run:
            body["fake"] = {"delay": steps * DRY_STEP_S}
        headers = {} if arm == "arrival" else {"X-LlamaSwap-Priority": priority}
        sent = time.time()
        answer = client.post("/v1/chat/completions", json=body, headers=headers)
        if answer.status_code != 200:
            errors.append(f"{tag}: {answer.status_code} {answer.text[:200]}")
        sent_at[tag] = {"sent": sent, "answered": time.time()}
        return sent, time.time()

    threads = [
        threading.Thread(target=send, args=(A, args.job_steps, f"job-{i}", "batch"))
        for i in range(args.jobs)
    ]
    for t in threads:
        t.start()
        time.sleep(0.01)  # in order: the queue's arrival order is the jobs' numbering
    t0 = time.time()

    def chat(k: int) -> None:
        send(B, args.chat_steps, f"chat-{k}", "interactive")

    k = 0
    offset = getattr(args, "chat_offset", 0.0)
    while (due := t0 + offset + k * args.chat_every) < t0 + args.span:
        time.sleep(max(0.0, due - time.time()))
        thread = threading.Thread(target=chat, args=(k,))
        thread.start()
        threads.append(thread)
        k += 1
    for t in threads:
        t.join()
    client.close()
    for e in errors:
        print(f"  {arm}: request failed: {e}", file=sys.stderr)
    return sent_at


def figures(
    arm: str, db: Path, log: Path, sent: dict[str, dict[str, float]], args: argparse.Namespace
) -> dict[str, Any]:
    chats = [v for tag, v in sent.items() if tag.startswith("chat-")]
    conn = sqlite3.connect(db)
    events = [
        (t, json.loads(d)) for t, d in conn.execute("SELECT type, data FROM events ORDER BY seq")
    ]
    conn.close()
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    # The decode intervals (start, end, model, when the request was queued): the
    # servers' own (ground truth), or on --dry-run gpulane's.
    work: list[tuple[float, float, str, float]] = []
    if args.dry_run:
        started: dict[str, tuple[float, str]] = {}
        model_of = {d["request_id"]: d["model"] for t, d in events if t == "request_dispatched"}
        queued = {d["request_id"]: d["at"] / 1e9 for t, d in events if t == "request_enqueued"}
        for t, d in events:
            if t == "request_started":
                started[d["request_id"]] = (d["at"] / 1e9, model_of.get(d["request_id"], ""))
            elif t == "request_completed" and d["request_id"] in started:
                since, model = started.pop(d["request_id"])
                work.append((since, d["at"] / 1e9, model, queued[d["request_id"]]))
    else:
        work = [
            (x["start"], x["end"], x["name"], sent.get(x["tag"], {}).get("sent", 0.0))
            for x in lines
            if x["ev"] == "work"
        ]
    work.sort()
    gaps, overheads = [], []
    own = sorted((x["t"], x) for x in lines if x["ev"] in ("sleep", "wake", "ready"))
    for (_, end1, m1, _), (start2, _, m2, queued2) in zip(work, work[1:], strict=False):
        if queued2 > end1:
            continue  # the lane was idle, not gpulane: nothing waited when the first ended
        if m1 == m2:
            gaps.append(start2 - end1)
            continue
        between = [x for t, x in own if end1 <= t <= start2]
        spent = sum(x.get("s", x.get("load_s", 0.0)) for x in between)
        overheads.append(start2 - end1 - spent)
    first = min((c["sent"] for c in chats), default=0.0)
    first = min([first, *(v["sent"] for v in sent.values())], default=first)
    last = max(
        [*(e for _, e, _, _ in work), *(v["answered"] for v in sent.values())], default=first
    )
    span = max(1e-9, last - first)
    cold = [x["load_s"] for x in lines if x["ev"] == "ready"]
    if args.dry_run:
        spawned = {d["model"]: d["at"] for t, d in events if t == "process_started"}
        cold = []
        for t, d in events:
            if t == "process_started":
                spawned[d["model"]] = d["at"]
            elif t == "swap_finished" and d["model"] in spawned:
                cold.append((d["at"] - spawned.pop(d["model"])) / 1e9)
    latency = [c["answered"] - c["sent"] for c in chats]
    return {
        "arm": arm,
        "events": events,
        "cold_starts": len(cold),
        "cold_start_s": _med(cold),
        "sleep_s": _med([x["s"] for x in lines if x["ev"] == "sleep"]),
        "wake_s": _med([x["s"] for x in lines if x["ev"] == "wake"]),
        "swaps": sum(1 for t, _ in events if t == "swap_started"),
        "dispatch_gap_ms": _med(gaps, 1000),
        "swap_overhead_s": _med(overheads),
        "chat_p50_s": _med(latency),
        "chat_max_s": max(latency, default=None),
        "gpu_busy": sum(e - s for s, e, _, _ in work) / span,
        "makespan_s": span,
    }


def _med(values: list[float], scale: float = 1.0) -> float | None:
    return statistics.median(values) * scale if values else None


def _cell(value: Any, fmt: str) -> str:
    width = int(fmt.split(".")[0] or 0)
    return "-".rjust(width) if value is None else format(value, fmt)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.gpu_bench", description=__doc__)
    p.add_argument("--gib", type=float, default=0.0, help="GiB of weights per server (0: auto)")
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--job-steps", type=int, default=150)
    p.add_argument("--chat-steps", type=int, default=10)
    p.add_argument("--chat-every", type=float, default=4.0)
    p.add_argument("--span", type=float, default=40.0)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--out", default="", help="also write the figures as JSON here")
    p.add_argument("--dry-run", action="store_true", help="fake servers, no GPU: checks the bench")
    args = p.parse_args(argv)
    found = None if args.dry_run else gpu()
    if found is None and not args.dry_run:
        print(
            "bench-gpu: no NVIDIA GPU with PyTorch here (torch.cuda.is_available() is false "
            "or torch is not installed): nothing to measure"
        )
        return 0
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        p.error(f"--arms: {', '.join(unknown)} is not one of {', '.join(ARMS)}")
    if found is not None:
        name, memory, host = found
        if not args.gib:
            # Two fit in neither GPU nor host memory at more than this; 56 GiB on an H200.
            args.gib = float(min(56, int(memory / (1 << 30) * 0.55), int(host / (1 << 30) * 0.4)))
        print(
            f"{name}: {memory / (1 << 30):.0f} GiB GPU, {host / (1 << 30):.0f} GiB host; "
            f"two servers of {args.gib:g} GiB"
        )
    else:
        args.gib = args.gib or 1.0
        print(
            "--dry-run: fake servers (tools/fake_sleeper.py), no GPU: "
            "the figures check the bench only"
        )
    if "memory" in arms and not memory_router_present(args.gib):
        print("memory: this gpulane has no memory router (routing.router.use: memory): skipped")
        arms.remove("memory")
    print(
        f"{args.jobs} batch jobs of {args.job_steps} steps on {A} queued at 0; "
        f"a {args.chat_steps}-step chat on {B} every {args.chat_every:g} s for {args.span:g} s\n"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpulane-gpu-bench-") as tmp:
        for arm in arms:
            t = time.monotonic()
            rows.append(run_arm(arm, args, Path(tmp)))
            print(f"  {arm}: {time.monotonic() - t:.0f} s", file=sys.stderr)
    for r in rows:
        r.pop("events", None)
    head = (
        f"{'arm':<8} {'cold':>4} {'cold s':>7} {'sleep s':>7} {'wake s':>7} {'swaps':>5} "
        f"{'gap ms':>7} {'swap+ s':>7} {'chat p50':>8} {'max':>6} {'busy':>6} {'makespan':>8}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['arm']:<8} {r['cold_starts']:>4} {_cell(r['cold_start_s'], '7.2f')} "
            f"{_cell(r['sleep_s'], '7.2f')} {_cell(r['wake_s'], '7.2f')} {r['swaps']:>5} "
            f"{_cell(r['dispatch_gap_ms'], '7.1f')} {_cell(r['swap_overhead_s'], '7.2f')} "
            f"{_cell(r['chat_p50_s'], '7.2f')}s {_cell(r['chat_max_s'], '5.1f')}s "
            f"{r['gpu_busy']:>6.1%} {r['makespan_s']:>7.0f}s"
        )
    print(
        "\ncold/sleep/wake: the server's own; gap: GPU idle between two requests of one model; "
        "swap+: GPU idle at a switch beyond the server's own sleep, wake or start"
    )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_bench.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
