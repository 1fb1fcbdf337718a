"""What a front with two peers costs per request, against the single-host path.
Prints figures; asserts nothing.

    .venv/bin/python -m bench.peer_bench [--rounds 300] [--warmup 50] [--keep DIR]

Starts four `gpulane serve` processes, each model's server being
tools.fake_upstream (answers at once):

- host: one gpulane with the model `m` (the single-host path);
- box2, box3: two gpulanes like it, the peers;
- front: a gpulane whose `peers` are box2 and box3, both serving `m` (a bare id
  two peers serve: the front queues it and sends it to a free peer,
  `concurrencyLimit` 1 each).

The same non-streaming chat completion is sent one at a time over keep-alive
connections to host and to front, in random order in each round so drift hits
both alike (the raw-socket client of bench.proxy_bench). Printed: the median
and p99 latency of each path, the front's added latency (median - median) and
their ratio; CPU time per request (user + system, all threads, from /proc) of
the host gpulane, of the front alone and of the whole front path (front + the
peer that served it), with their ratios to the host's.
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import textwrap
from contextlib import ExitStack
from pathlib import Path

from bench.proxy_bench import (
    FAKE_NODELAY,
    REPO,
    Conn,
    cpu_seconds,
    free_port,
    pct,
    request_bytes,
    stop,
    wait_port,
)

MODEL = "m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def start(tmp: Path, name: str, config_text: str) -> tuple[subprocess.Popen[bytes], int]:
    folder = tmp / name
    folder.mkdir()
    (folder / "config.yaml").write_text(config_text)
    port = free_port()
    log = folder / "gpulane.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--config", str(folder / "config.yaml")]
        + ["--listen", f"127.0.0.1:{port}", "--db", str(folder / "gpulane.db")],
        cwd=REPO,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    wait_port(port, proc, log)
    return proc, port


def host_config() -> str:
    return textwrap.dedent(
        f"""\
        startPort: {free_port()}
        logLevel: warn
        models:
          {MODEL}:
            cmd: {sys.executable} -c '{FAKE_NODELAY}' --port ${{PORT}} --name {MODEL}
            proxy: http://127.0.0.1:${{PORT}}
        """
    )


def front_config(peers: dict[str, int]) -> str:
    lines = ["logLevel: warn", "models:", "  local:", "    cmd: unused --port ${PORT}", "peers:"]
    for name, port in peers.items():
        lines += [f"  {name}:", f"    proxy: http://127.0.0.1:{port}", f"    models: [{MODEL}]"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--keep", type=Path, help="keep the servers' folders here")
    args = parser.parse_args(argv)
    with ExitStack() as stack:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            tmp = args.keep
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="peer-bench-")))
        procs: dict[str, subprocess.Popen[bytes]] = {}
        ports: dict[str, int] = {}
        for name in ("host", "box2", "box3"):
            procs[name], ports[name] = start(tmp, name, host_config())
            stack.callback(stop, procs[name])
        peers = {"box2": ports["box2"], "box3": ports["box3"]}
        procs["front"], ports["front"] = start(tmp, "front", front_config(peers))
        stack.callback(stop, procs["front"])
        dbs = {name: tmp / name / "gpulane.db" for name in procs}
        run(procs, ports, dbs, args.rounds, args.warmup)


def run(
    procs: dict[str, subprocess.Popen[bytes]],
    ports: dict[str, int],
    dbs: dict[str, Path],
    rounds: int,
    warmup: int,
) -> None:
    body = json.dumps(CHAT).encode()
    paths = ("host", "front")
    payloads = {p: request_bytes(ports[p], "/v1/chat/completions", body) for p in paths}
    conns = {p: Conn(ports[p]) for p in paths}
    seconds: dict[str, list[float]] = {p: [] for p in paths}
    served: dict[str, int] = {}
    rng = random.Random(1)
    order = list(paths)
    cpu0: dict[str, float] = {}
    try:
        for i in range(warmup + rounds):
            if i == warmup:
                cpu0 = {name: cpu_seconds(proc.pid) for name, proc in procs.items()}
            rng.shuffle(order)
            for path in order:
                took, resp = conns[path].call(payloads[path])
                if resp.status != 200:
                    raise RuntimeError(f"{path}: HTTP {resp.status} {resp.body[:300]!r}")
                if i >= warmup:
                    seconds[path].append(took)
        cpu = {name: cpu_seconds(proc.pid) - cpu0[name] for name, proc in procs.items()}
    finally:
        for conn in conns.values():
            conn.close()
    for name in ("box2", "box3"):
        served[name] = _requests(dbs[name])
    report(seconds, cpu, served, rounds)


def _requests(db: Path) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute("SELECT count(*) FROM requests").fetchone()[0])
    finally:
        conn.close()


def report(
    seconds: dict[str, list[float]], cpu: dict[str, float], served: dict[str, int], rounds: int
) -> None:
    host, front = seconds["host"], seconds["front"]
    h50, f50 = statistics.median(host) * 1e3, statistics.median(front) * 1e3
    h99, f99 = pct(host, 99) * 1e3, pct(front, 99) * 1e3
    print(f"\nlatency (ms; {rounds} requests per path, one at a time, keep-alive)")
    print(f"  {'path':28} {'median':>8} {'p99':>8}")
    print(f"  {'single host (client->host)':28} {h50:8.3f} {h99:8.3f}")
    print(f"  {'front (client->front->peer)':28} {f50:8.3f} {f99:8.3f}")
    print(f"  added by the front: median {f50 - h50:.3f} ms, ratio {f50 / h50:.2f}x")
    per = {name: value / rounds * 1e3 for name, value in cpu.items()}
    peers = per["box2"] + per["box3"]
    print("\nCPU per request (ms, user + system, all threads)")
    print(f"  single host gpulane        {per['host']:8.3f}")
    print(f"  front gpulane alone        {per['front']:8.3f}  ({per['front'] / per['host']:.2f}x)")
    whole = per["front"] + peers
    print(f"  front + peer gpulanes      {whole:8.3f}  ({whole / per['host']:.2f}x)")
    print(f"  requests each peer served (warm-up included): {served}")


if __name__ == "__main__":
    main()
