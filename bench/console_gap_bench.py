"""The dispatch gap at 10,000 queued, with and without five consoles polling the
queue page once a second, side by side in one run (issue 23, item 7). Prints
figures (docs/benchmarks.md), asserts nothing.

    python -m bench.console_gap_bench [--waiting 10000] [--rounds 3] [--arm-s 3]

Starts `gpulane serve` in front of a fake upstream that answers at once, holds
the GPU with a request that hangs, and queues `--waiting` durable jobs (batch
and normal, 7 callers) behind it. Then `--clients` synchronous interactive clients,
each sending its next request when the last one is answered, keep the lane busy
(they go before the 10,000, which stay queued; so the gaps sampled are theirs), and arms
of `--arm-s` seconds alternate: none polling, then five consoles (five threads,
each its own connection, phases 0.2 s apart) each GETting the console's poll
(`/ui/api/queue?offset=0&limit=100`) once a second; `--rounds` of each,
interleaved. The queue's depth at each arm's start and end is printed.

The gap is gpulane's own: from the events, each `request_completed.at` to the
next `request_started.at`, for completions inside an arm (its first 0.3 s left
out). Per arm: p50, p99, max; then the ratio of each round's p99 (five polling
over none), the median of those ratios, and the p99 of every arm's gaps pooled.
The gap is stamped by the run loop at both ends, so a stall of the loop shows in
it only when it falls between a completion and the next start; the clients'
latency (p99 per arm, and pooled) shows every stall.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sqlite3
import statistics
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import httpx

from bench.console_bench import fill
from bench.proxy_bench import FAKE_NODELAY, _one, request_bytes
from tests.e2e.gateway import Gateway

POLL = "/ui/api/queue?offset=0&limit=100"
CONSOLES = 5
SETTLE_S = 0.3


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def consoles(url: str, stop: threading.Event, polls: list[float]) -> list[threading.Thread]:
    """Five pollers, each once a second, phases spread over the second."""

    def poll(phase: float) -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            next_at = time.monotonic() + phase
            while not stop.wait(max(0.0, next_at - time.monotonic())):
                t = time.perf_counter()
                client.get(POLL).raise_for_status()
                polls.append((time.perf_counter() - t) * 1000)
                next_at += 1.0

    threads = [
        threading.Thread(target=poll, args=(i / CONSOLES,), daemon=True) for i in range(CONSOLES)
    ]
    for t in threads:
        t.start()
    return threads


async def clients(
    port: int, n: int, done: threading.Event, answered: list[tuple[int, float]]
) -> None:
    """`n` closed-loop interactive clients until `done`; each answer's (unix ns,
    latency in ms) goes to `answered`."""
    body = json.dumps({"model": "A", "messages": [{"role": "user", "content": "hi"}]}).encode()
    payload = request_bytes(
        port, "/v1/chat/completions", body, "X-LlamaSwap-Priority: interactive\r\n"
    )

    async def client() -> None:
        while not done.is_set():
            t = time.perf_counter()
            status = await _one(port, payload)
            answered.append((time.time_ns(), (time.perf_counter() - t) * 1000))
            if status != 200:
                raise RuntimeError(f"a client's request failed: {status}")

    await asyncio.gather(*(client() for _ in range(n)))


def gaps(db: Path, since_ns: int, until_ns: int) -> list[float]:
    """request_completed -> next request_started, in ms, completions in the window."""
    conn = sqlite3.connect(db, timeout=30)
    try:
        rows = conn.execute(
            "SELECT type, data FROM events WHERE type IN ('request_started',"
            " 'request_completed') ORDER BY seq"
        ).fetchall()
    finally:
        conn.close()
    out, last_end = [], None
    for kind, data in rows:
        at = json.loads(data)["at"]
        if kind == "request_completed":
            last_end = at
        elif last_end is not None:
            if since_ns <= last_end < until_ns:
                out.append((at - last_end) / 1e6)
            last_end = None
    return out


def depth(url: str) -> int:
    return int(httpx.get(url + "/ui/api/queue?limit=1", timeout=60).json()["total_waiting"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waiting", type=int, default=10_000)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arm-s", type=float, default=3.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # The fake with TCP_NODELAY (bench.proxy_bench): else each reply waits ~40 ms
        # for the client's delayed ACK, and the lane would idle on it.
        config = textwrap.dedent(
            f"""\
            shutdownGrace: 0
            logLevel: warn
            models:
              A:
                cmd: {sys.executable} -c '{FAKE_NODELAY}' --port ${{PORT}} --name A
                checkEndpoint: /health
            """
        )
        gw = Gateway(Path(tmp), config).start()
        try:
            hang = json.dumps({"model": "A", "messages": [], "fake": {"hang": True}}).encode()
            blocker = socket.create_connection(("127.0.0.1", gw.port))
            blocker.sendall(request_bytes(gw.port, "/v1/chat/completions", hang))
            gw.wait_for("SELECT 1 FROM requests WHERE status = 'running'", timeout=30)
            t0 = time.perf_counter()
            fill(gw, args.waiting, ("batch", "normal"))
            print(f"queued {args.waiting:,} durable jobs in {time.perf_counter() - t0:.1f} s")
            done, answered = threading.Event(), list[tuple[int, float]]()
            load = threading.Thread(
                target=asyncio.run,
                args=(clients(gw.port, args.clients, done, answered),),
                daemon=True,
            )
            load.start()
            time.sleep(0.5)  # the clients queued behind the hanging request
            blocker.close()  # the GPU is free: the clients' requests go through the fake
            arms: list[tuple[str, int, int, int, int, list[float]]] = []
            for _ in range(args.rounds):
                for kind in ("none", "five"):
                    before = depth(gw.url)
                    stop, polls = threading.Event(), list[float]()
                    start = time.time_ns()
                    threads = consoles(gw.url, stop, polls) if kind == "five" else []
                    time.sleep(args.arm_s)
                    end = time.time_ns()
                    stop.set()
                    for t in threads:
                        t.join()
                    arms.append((kind, start, end, before, depth(gw.url), polls))
            done.set()
            load.join()
            time.sleep(0.5)  # the last events committed (group commit)
            print(
                f"{'arm':>5} {'depth':>13} {'gaps':>5} {'gap p50':>8} {'gap p99':>8} "
                f"{'gap max':>8} {'client p99':>10} {'poll wall, median':>18}   (ms)"
            )
            p99: dict[str, list[float]] = {"none": [], "five": []}
            pooled: dict[str, list[float]] = {"none": [], "five": []}
            latency: dict[str, list[float]] = {"none": [], "five": []}
            for kind, start, end, d0, d1, polls in arms:
                since = start + int(SETTLE_S * 1e9)
                g = gaps(gw.db, since, end)
                lat = [ms for at, ms in answered if since <= at < end]
                p99[kind].append(_pct(g, 0.99))
                pooled[kind] += g
                latency[kind] += lat
                poll = f"{statistics.median(polls):.1f} ({len(polls)})" if polls else "-"
                print(
                    f"{kind:>5} {d0:>6}-{d1:<6} {len(g):>5} {_pct(g, 0.5):8.3f} "
                    f"{_pct(g, 0.99):8.3f} {max(g):8.3f} {_pct(lat, 0.99):10.1f} {poll:>18}"
                )
            ratios = [f / n for f, n in zip(p99["five"], p99["none"], strict=True)]
            print(
                "dispatch gap p99, five consoles / none, per round: "
                + ", ".join(f"{r:.2f}" for r in ratios)
                + f"; median {statistics.median(ratios):.2f}"
            )
            for label, figures in (("dispatch gap", pooled), ("client latency", latency)):
                none, five = _pct(figures["none"], 0.99), _pct(figures["five"], 0.99)
                print(
                    f"{label} p99, all arms pooled: none {none:.2f} ms, five consoles "
                    f"{five:.2f} ms ({five / none:.2f}x)"
                )
        finally:
            gw.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
