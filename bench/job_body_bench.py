"""A large durable job: time to acknowledge, peak memory, disk. Prints figures.

    python -m bench.job_body_bench [--sizes 16,60] [--runs 3] [--tree DIR]

For each size (MiB), `gpulane serve` is started as a user does, on a fresh
database, in front of tools/fake_upstream. A hanging batch job holds the lane,
so the large job (one JSON chat request, `Prefer: respond-async`) waits in the
queue; then the blocker is cancelled and the large job runs. Measured:

- ack: from sending the request to its 202 (a client on this host);
- ack peak: the server's peak RSS (VmHWM, reset just before) minus its RSS
  before, while the job is accepted;
- run peak: the same while it runs (read back, sent upstream);
- disk: the growth of the database file and its write-ahead log at the 202,
  after one more small write (the log is cut back then).

Each is the median of --runs runs, as a multiple of the body too. `--tree`
runs another checkout (e.g. `git worktree add /tmp/old HEAD~1`, or `git
archive`), to compare storage formats side by side with this interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss(pid: int) -> dict[str, int]:
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) * 1024
    return found


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def on_disk(db: Path) -> int:
    return sum(p.stat().st_size for p in (db, Path(f"{db}-wal")) if p.exists())


def body_of(size: int) -> bytes:
    rng = random.Random(size)
    text = "".join(rng.choices(string.ascii_letters + string.digits, k=size))
    doc = {"model": "A", "messages": [{"role": "user", "content": text}], "fake": {"digest": True}}
    return json.dumps(doc).encode()


def one_run(tree: Path, body: bytes) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="gpulane-body-bench-"))
    db = tmp / "gpulane.db"
    port = free_port()
    (tmp / "config.yaml").write_text(
        textwrap.dedent(
            f"""\
            startPort: {free_port()}
            models:
              A:
                cmd: {sys.executable} -m tools.fake_upstream --port ${{PORT}} --name A
                checkEndpoint: /health
            """
        )
    )
    argv = [sys.executable, "-m", "app.cli", "serve", "--config", str(tmp / "config.yaml")]
    argv += ["--listen", f"127.0.0.1:{port}", "--db", str(db)]
    log = (tmp / "gpulane.log").open("wb")
    proc = subprocess.Popen(argv, cwd=tree, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    async_ = {"Prefer": "respond-async"}
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if client.get("/health").text == "OK":
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError((tmp / "gpulane.log").read_text())
                time.sleep(0.05)
            blocker = client.post(
                "/v1/chat/completions",
                json={"model": "A", "messages": [], "fake": {"hang": True}},
                headers=async_ | {"X-LlamaSwap-Priority": "batch"},
            ).json()["id"]
            while client.get(f"/v1/jobs/{blocker}").json()["status"] != "running":
                time.sleep(0.05)
            time.sleep(0.5)
            before, disk_before = rss(proc.pid)["VmRSS"], on_disk(db)
            reset_peak(proc.pid)
            started = time.perf_counter()
            r = client.post(
                "/v1/chat/completions",
                content=body,
                headers=async_ | {"Content-Type": "application/json"},
            )
            ack = time.perf_counter() - started
            assert r.status_code == 202, r.text
            job = r.json()["id"]
            ack_peak = rss(proc.pid)["VmHWM"] - before
            client.post("/v1/chat/completions", json={"model": "none", "messages": []})
            time.sleep(0.2)
            disk = on_disk(db) - disk_before
            before = rss(proc.pid)["VmRSS"]
            reset_peak(proc.pid)
            client.delete(f"/v1/jobs/{blocker}")
            while client.get(f"/v1/jobs/{job}").json()["status"] not in ("completed", "failed"):
                time.sleep(0.05)
            run_peak = rss(proc.pid)["VmHWM"] - before
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    return {"ack_s": ack, "ack_peak": ack_peak, "run_peak": run_peak, "disk": disk}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16,60", help="body sizes in MiB, comma separated")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tree", type=Path, default=REPO, help="the checkout to run")
    args = parser.parse_args(argv)
    print(f"tree {args.tree}, {args.runs} runs, load {os.getloadavg()[0]:.1f}")
    print("| body | ack | ack peak RSS | run peak RSS | disk at 202 |")
    print("|---|---|---|---|---|")
    for size in (int(s) for s in args.sizes.split(",")):
        body = body_of(size * MIB)
        runs = [one_run(args.tree, body) for _ in range(args.runs)]
        m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        n = len(body)
        print(
            f"| {n / MIB:.0f} MiB | {m['ack_s']:.2f} s "
            f"| {m['ack_peak'] / MIB:.0f} MiB ({m['ack_peak'] / n:.1f}x) "
            f"| {m['run_peak'] / MIB:.0f} MiB ({m['run_peak'] / n:.1f}x) "
            f"| {m['disk'] / MIB:.0f} MiB ({m['disk'] / n:.2f}x) |"
        )


if __name__ == "__main__":
    main()
