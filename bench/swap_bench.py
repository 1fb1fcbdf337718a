"""What gpulane adds to stopping and starting a real llama-server. Prints figures; asserts nothing.

    .venv/bin/python -m bench.swap_bench [--rounds 15] [--ctx 2048] [--upstream FILE] [--no-serve]

Needs the llama-server and SmolLM2 model that `make llama` builds (see
docs/llama.md); builds them on first use.

Each round runs the same llama-server command every way below, in an order
that reverses each round so drift hits all alike, each way on ports of its own:

(a) direct: `subprocess.Popen` with output to /dev/null, `GET /health` polled
    every millisecond over a bare socket until it answers 200 (start); then
    SIGTERM and `Popen.wait()` until it exited (stop). The floor: the server's
    own start and stop, measured as finely as polling allows.
    direct+idle: the same, with one idle keep-alive connection open at the
    SIGTERM, as a proxy's connection pool leaves one after a request.
(b) gpulane: `UpstreamProcess.start()` (the port check, spawn with its output
    captured line by line, health polls, the check that the listener is the
    upstream's), then `UpstreamProcess.stop()` (SIGTERM to the group, the look
    for anything it started, output drained), on uvloop as `gpulane serve` runs.
(c) served: `gpulane serve` (a subprocess, started as a user starts it) with
    two models `a` and `b` running that command behind the default proxy
    (`http://localhost:${PORT}`); a one-token chat completion to the other
    model each round makes one swap, timed from gpulane's own events: stop =
    `swap_started` -> `process_stopped` of the evicted model, start = that ->
    `swap_finished`; also the recorded `swap_finished.duration_ms`. The
    scheduler's whole path, not only UpstreamProcess. --no-serve skips it.

Printed: per way the median, min and max of start, stop and their sum (a swap
is one stop and one start), and the differences of the medians from direct:
what gpulane adds. Target (issue 10): the sum within 50 ms of direct.

--upstream FILE loads UpstreamProcess from FILE instead of app/runtime/upstream.py,
to measure an older version side by side (`git show REV:app/runtime/upstream.py > FILE`);
it applies to (b) only.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import httpx
import uvloop

from app.runtime import upstream as current_upstream
from app.runtime.log_buffer import LogBuffer
from tools.fetch_llama import fetch

REPO = Path(__file__).resolve().parents[1]
HEALTH_TIMEOUT = 60.0
DIRECT_POLL = 0.001
SERVED_MODELS = ("a", "b")


@dataclass(frozen=True)
class Spec:
    """An UpstreamSpec as the config resolver would make it for this model."""

    id: str
    cmd: tuple[str, ...]
    proxy: str
    cmd_stop: tuple[str, ...] | None = None
    env: dict[str, str] = field(default_factory=dict)
    check_endpoint: str | None = "/health"
    unload_timeout: float = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command(server: Path, model: Path, port: int, ctx: int) -> tuple[str, ...]:
    return (
        str(server),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-m",
        str(model),
        "-c",
        str(ctx),
    )


def health_status(port: int) -> int | None:
    """One GET /health over a bare socket; None while nothing answers."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            head = s.recv(64)
    except OSError:
        return None
    parts = head.split(None, 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def direct_round(cmd: tuple[str, ...], port: int, idle: bool = False) -> tuple[float, float]:
    conn: socket.socket | None = None
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        while health_status(port) != 200:
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited with {proc.returncode} while starting")
            if time.perf_counter() - t0 > HEALTH_TIMEOUT:
                raise SystemExit("llama-server was not healthy within 60 s")
            time.sleep(DIRECT_POLL)
        started = time.perf_counter() - t0
        if idle:
            conn = socket.create_connection(("127.0.0.1", port))
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            conn.recv(4096)
        t1 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        return started, time.perf_counter() - t1
    finally:
        if conn is not None:
            conn.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def gpulane_round(module: ModuleType, spec: Spec) -> tuple[float, float]:
    upstream = module.UpstreamProcess(spec, health_check_timeout=HEALTH_TIMEOUT, logs=LogBuffer())
    t0 = time.perf_counter()
    try:
        await upstream.start()
        started = time.perf_counter() - t0
        t1 = time.perf_counter()
        await upstream.stop()
        return started, time.perf_counter() - t1
    finally:
        await upstream.stop()


class Served:
    """`gpulane serve` with two models running the same llama-server command."""

    def __init__(self, tmp: Path, server: Path, model: Path, ctx: int) -> None:
        models = "".join(
            f"""
              {name}:
                cmd: {server} --port ${{PORT}} -m {model} -c {ctx}
            """
            for name in SERVED_MODELS
        )
        config = tmp / "config.yaml"
        config.write_text(
            textwrap.dedent(f"""\
                startPort: {free_port_pair()}
                logLevel: warn
                healthCheckTimeout: {HEALTH_TIMEOUT:g}
                models:""")
            + textwrap.indent(textwrap.dedent(models), "  ")
        )
        self.db = tmp / "gpulane.db"
        self.port = free_port()
        self.log = tmp / "gpulane.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--config", str(config)]
            + ["--listen", f"127.0.0.1:{self.port}", "--db", str(self.db)],
            cwd=REPO,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
        )
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=120)
        deadline = time.monotonic() + 30
        while health_status(self.port) != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"gpulane serve did not start:\n{self.log.read_text()}")
            time.sleep(0.05)
        self.requests = 0

    def swap(self) -> None:
        """One request to the model not resident: one swap (none for the first)."""
        model = SERVED_MODELS[self.requests % 2]
        self.requests += 1
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        r = self.client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            raise SystemExit(f"request to {model}: HTTP {r.status_code} {r.text[:300]}")

    def close(self) -> list[tuple[float, float, float]]:
        """(stop, start, recorded duration) in seconds of each swap from one model to the other."""
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with sqlite3.connect(self.db) as conn:
            rows = conn.execute(
                "SELECT type, data FROM events WHERE type IN "
                "('swap_started', 'process_stopped', 'swap_finished') ORDER BY seq"
            ).fetchall()
        swaps = []
        started: tuple[int, str] | None = None  # (at, from_model) of an open swap
        stopped: int | None = None
        for kind, data in rows:
            event = json.loads(data)
            at = event["at"]  # exact nanoseconds
            if kind == "swap_started" and event.get("from_model"):
                started, stopped = (at, event["from_model"]), None
            elif kind == "process_stopped" and started and event["model"] == started[1]:
                stopped = at
            elif kind == "swap_finished" and started and stopped is not None:
                ns = 1e-9
                swaps.append(
                    ((stopped - started[0]) * ns, (at - stopped) * ns, event["duration_ms"] / 1000)
                )
                started = None
        return swaps


def free_port_pair() -> int:
    while True:
        first = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", first + 1))
            return first
        except OSError:
            continue


def load_upstream(path: str | None) -> ModuleType:
    if path is None:
        return current_upstream
    loader = importlib.util.spec_from_file_location("bench_upstream_under_test", path)
    if loader is None or loader.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module


def summary(values: list[float]) -> str:
    ms = [v * 1000 for v in values]
    return f"{statistics.median(ms):7.1f} ms  ({min(ms):6.1f} - {max(ms):6.1f})"


async def run(args: argparse.Namespace) -> None:
    fetched = fetch()
    module = load_upstream(args.upstream)
    direct_port, gpulane_port = free_port(), free_port()
    direct_cmd = command(fetched.server, fetched.model, direct_port, args.ctx)
    spec = Spec(
        id="smollm2",
        cmd=command(fetched.server, fetched.model, gpulane_port, args.ctx),
        proxy=f"http://127.0.0.1:{gpulane_port}",
    )
    rows: dict[str, list[tuple[float, float]]] = {"direct": [], "direct+idle": [], "gpulane": []}
    ways = [*rows] + ([] if args.no_serve else ["served"])
    loop = asyncio.get_running_loop()
    with tempfile.TemporaryDirectory(prefix="gpulane-swap-bench-") as tmp:
        served = None
        try:
            if not args.no_serve:
                served = Served(Path(tmp), fetched.server, fetched.model, args.ctx)
                served.swap()  # the first load is no swap
            # One unmeasured round each: the model file into the page cache, imports warm.
            direct_round(direct_cmd, direct_port)
            await gpulane_round(module, spec)
            for i in range(args.rounds):
                for way in ways if i % 2 == 0 else ways[::-1]:
                    if way == "gpulane":
                        rows[way].append(await gpulane_round(module, spec))
                    elif way == "served":
                        assert served is not None
                        await loop.run_in_executor(None, served.swap)
                    else:  # in a thread: blocking waits must not stall this loop
                        idle = way == "direct+idle"
                        rows[way].append(
                            await loop.run_in_executor(
                                None, direct_round, direct_cmd, direct_port, idle
                            )
                        )
        finally:
            recorded = [] if served is None else served.close()
    if recorded:
        rows["served"] = [(start, stop) for stop, start, _ in recorded]
    print(
        f"llama-server + SmolLM2-135M Q4_1, -c {args.ctx}; {args.rounds} rounds, "
        f"interleaved; load {os.getloadavg()[0]:.2f}; (b) from "
        f"{args.upstream or 'app/runtime/upstream.py'}"
    )
    print("median (min - max)")
    medians: dict[str, tuple[float, float, float]] = {}
    for way, rounds in rows.items():
        starts = [start for start, _ in rounds]
        stops = [stop for _, stop in rounds]
        swaps = [start + stop for start, stop in rounds]
        m = [statistics.median(v) * 1000 for v in (starts, stops, swaps)]
        medians[way] = (m[0], m[1], m[2])
        print(
            f"  {way:11} start {summary(starts)}  stop {summary(stops)}  "
            f"stop+start {summary(swaps)}"
        )
    if recorded:
        durations = summary([d for _, _, d in recorded])
        print(f"  served      recorded swap_finished.duration_ms {durations}")
    d = medians["direct"]
    for way, g in medians.items():
        if way != "direct":
            print(
                f"  {way + ' added':17} start {g[0] - d[0]:+7.1f} ms  stop {g[1] - d[1]:+7.1f} ms"
                f"  stop+start {g[2] - d[2]:+7.1f} ms"
            )
    print("  target (issue 10): gpulane and served stop+start within +50 ms of direct")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--ctx", type=int, default=2048, help="llama-server -c")
    parser.add_argument("--upstream", help="a file holding another version of upstream.py")
    parser.add_argument("--no-serve", action="store_true", help="skip (c), gpulane serve")
    args = parser.parse_args()
    uvloop.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
