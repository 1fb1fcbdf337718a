"""A 10,000-line batch against 10,000 single durable jobs, side by side. Prints figures.

    python -m bench.batch_bench [--lines 10000] [--runs 3] [--concurrency 8] [--tree DIR]
                                [--before DIR] [--no-singles]

Each run starts `gpulane serve` as a user does, on a fresh database, in front
of tools/fake_upstream, with `maxQueuedPerCaller` raised above the line count
(the singles are one caller's jobs; a batch's lines are not counted against
that bound, docs/jobs.md). A hanging job holds the lane first, so nothing
else runs and every line stays queued. Then, for each kind:

- batch: `POST /v1/files` (multipart, the JSONL of N chat requests), then
  `POST /v1/batches`, which answers once every line's enqueue is on disk
  (status `in_progress`): submit is from the first byte of the upload to that
  answer, split into upload and create;
- singles: N chat requests with `Prefer: respond-async`, `--concurrency` at a
  time on keep-alive connections: submit is from the first request to the
  last 202.

Then gpulane is killed (SIGKILL) and started again on the same database, and
measured from just before the spawn: until `/health` answers, until the first
answer about the work (`GET /v1/batches/{id}` with its progress, or `GET
/v1/jobs/{id}` of the last single), the server's CPU time and peak RSS then,
and the open jobs recovery put back. Before each start the disk is synced, so
one run's writeback does not stall the next. The kinds alternate within a run;
each figure is the median of --runs runs, and the ratios are the batch's
median over the others', so the host's speed cancels out. `--tree` runs
another checkout (`git archive REV | tar -x -C DIR`) with this interpreter;
`--before DIR` runs that checkout's batch too, interleaved, for a before/after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
CHAT = "/v1/chat/completions"
RECOVERED = re.compile(r"recovery: (\d+) jobs resumed, (\d+) re-queued")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def line_body(i: int) -> dict[str, Any]:
    return {"model": "A", "messages": [{"role": "user", "content": f"shot {i}"}], "fake": {}}


def jsonl(n: int) -> bytes:
    rows = (
        {"custom_id": f"shot-{i:05}", "method": "POST", "url": CHAT, "body": line_body(i)}
        for i in range(n)
    )
    return "\n".join(json.dumps(r) for r in rows).encode() + b"\n"


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Server:
    """One `gpulane serve` on `db`, killed with SIGKILL (its fake upstreams too)."""

    def __init__(self, tree: Path, work: Path, db: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (work / "gpulane.log").open("ab")
        self.spawned = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--config", str(work / "config.yaml")]
            + ["--listen", f"127.0.0.1:{self.port}", "--db", str(db)],
            cwd=tree,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.work = work

    def wait_health(self, client: httpx.Client) -> float:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError((self.work / "gpulane.log").read_text())
            try:
                if client.get(f"{self.url}/health", timeout=1).text == "OK":
                    return time.perf_counter() - self.spawned
            except httpx.HTTPError:
                pass
            time.sleep(0.005)
        raise RuntimeError("no /health:\n" + (self.work / "gpulane.log").read_text())

    def kill(self) -> None:
        children = []
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*"):
            try:
                children += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        for pid in children:  # our fake upstreams
            try:
                if b"tools.fake_upstream" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass
        self.log.close()


def config(work: Path, lines: int) -> None:
    (work / "config.yaml").write_text(
        textwrap.dedent(
            f"""\
            startPort: {free_port()}
            maxQueuedPerCaller: {lines * 2}
            routing:
              scheduler:
                settings:
                  serial:
                    agingDivisor: 86400
            models:
              A:
                cmd: {sys.executable} -m tools.fake_upstream --port ${{PORT}} --name A
                checkEndpoint: /health
            """
        )
    )


def block_lane(client: httpx.Client, url: str) -> None:
    r = client.post(
        f"{url}{CHAT}",
        json={"model": "A", "messages": [], "fake": {"hang": True}},
        headers={"Prefer": "respond-async", "X-LlamaSwap-Priority": "interactive"},
    )
    job = r.json()["id"]
    while client.get(f"{url}/v1/jobs/{job}").json()["status"] != "running":
        time.sleep(0.05)


def submit_batch(client: httpx.Client, url: str, lines: int) -> tuple[dict[str, float], str]:
    data = jsonl(lines)
    t0 = time.perf_counter()
    r = client.post(
        f"{url}/v1/files",
        files={"file": ("lines.jsonl", data, "application/jsonl")},
        data={"purpose": "batch"},
    )
    assert r.status_code == 200, r.text
    t1 = time.perf_counter()
    r = client.post(
        f"{url}/v1/batches",
        json={"input_file_id": r.json()["id"], "endpoint": CHAT, "completion_window": "24h"},
    )
    t2 = time.perf_counter()
    batch = r.json()
    assert batch.get("status") == "in_progress", r.text
    assert batch["request_counts"]["total"] == lines, batch
    return {"upload_s": t1 - t0, "create_s": t2 - t1, "submit_s": t2 - t0}, batch["id"]


async def _singles(url: str, lines: int, concurrency: int) -> list[str]:
    ids: list[str] = [""] * lines
    todo = iter(range(lines))
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            for i in todo:
                r = await client.post(CHAT, json=line_body(i), headers={"Prefer": "respond-async"})
                assert r.status_code == 202, r.text
                ids[i] = r.json()["id"]

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ids


def submit_singles(url: str, lines: int, concurrency: int) -> tuple[dict[str, float], str]:
    t0 = time.perf_counter()
    ids = asyncio.run(_singles(url, lines, concurrency))
    return {"submit_s": time.perf_counter() - t0}, ids[-1]


def one_run(tree: Path, kind: str, lines: int, concurrency: int) -> dict[str, float]:
    os.sync()  # the last run's writes reach the disk before this one is timed
    work = Path(tempfile.mkdtemp(prefix=f"gpulane-batch-bench-{kind}-"))
    db = work / "gpulane.db"
    config(work, lines)
    with httpx.Client(timeout=300) as client:
        server = Server(tree, work, db)
        try:
            server.wait_health(client)
            block_lane(client, server.url)
            if kind == "batch":
                got, target = submit_batch(client, server.url, lines)
                follow = f"/v1/batches/{target}"
            else:
                got, target = submit_singles(server.url, lines, concurrency)
                follow = f"/v1/jobs/{target}"
            got["submit_cpu_s"] = cpu_s(server.proc.pid)
        finally:
            server.kill()
        os.sync()
        server = Server(tree, work, db)
        try:
            got["health_s"] = server.wait_health(client)
            r = client.get(f"{server.url}{follow}")
            got["first_answer_s"] = time.perf_counter() - server.spawned
            assert r.status_code == 200, r.text
            if kind == "batch":
                progress = r.json().get("gpulane_progress") or {}
                assert progress.get("waiting") == lines, r.text[:500]
            got["start_cpu_s"] = cpu_s(server.proc.pid)
            got["start_rss_mib"] = peak_rss_mib(server.proc.pid)
        finally:
            server.kill()
    # Its recovery line (the recovery_finished event may not have been committed
    # when the server was killed).
    said = RECOVERED.findall((work / "gpulane.log").read_text(errors="replace"))
    got["restored"] = float(sum(int(n) for n in said[-1])) if said else 0.0
    return got


ROWS = [
    ("upload_s", "upload (POST /v1/files)", "s"),
    ("create_s", "create (POST /v1/batches)", "s"),
    ("submit_s", "submit: all lines queued, on disk", "s"),
    ("submit_cpu_s", "  gpulane CPU until then", "s"),
    ("health_s", "restart (SIGKILL): /health", "s"),
    ("first_answer_s", "restart: first answer about the work", "s"),
    ("start_cpu_s", "  gpulane CPU until then", "s"),
    ("start_rss_mib", "  peak RSS until then", "MiB"),
    ("restored", "jobs put back by recovery", ""),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8, help="singles in flight")
    parser.add_argument("--tree", type=Path, default=REPO, help="the checkout to run")
    parser.add_argument(
        "--before",
        type=Path,
        help="another checkout whose batch is run alongside, for a before/after",
    )
    parser.add_argument("--no-singles", action="store_true", help="only the batch (and --before)")
    args = parser.parse_args(argv)
    print(
        f"tree {args.tree}, before {args.before}, {args.lines} lines, {args.runs} runs, "
        f"singles {args.concurrency} at a time, load {os.getloadavg()[0]:.1f}"
    )
    kinds: dict[str, tuple[Path, str]] = {"batch": (args.tree, "batch")}
    if args.before is not None:
        kinds["batch (before)"] = (args.before, "batch")
    if not args.no_singles:
        kinds[f"{args.lines} singles"] = (args.tree, "singles")
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for _ in range(args.runs):  # interleaved: the host's speed moves between runs
        for label, (tree, kind) in kinds.items():
            runs[label].append(one_run(tree, kind, args.lines, args.concurrency))
    labels = list(kinds)
    ratios = [f"batch / {label}" for label in labels[1:]]
    print("| median of " + " | ".join([str(args.runs), *labels, *ratios]) + " |")
    print("|---" + "|--:" * (len(labels) + len(ratios)) + "|")
    for key, name, unit in ROWS:
        cells: list[float | None] = []
        for label in labels:
            values = [r[key] for r in runs[label] if key in r]
            cells.append(statistics.median(values) if values else None)
        fmt = "{:.0f}" if unit in ("MiB", "") else "{:.2f}"
        shown = ["-" if c is None else fmt.format(c) + (f" {unit}" if unit else "") for c in cells]
        first = cells[0]
        shown += [f"{first / c:.2f}" if first is not None and c else "-" for c in cells[1:]]
        print(f"| {name} | " + " | ".join(shown) + " |")


if __name__ == "__main__":
    main()
