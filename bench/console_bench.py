"""The web console with 10,000 waiting requests: first paint of the queue page and
the server's cost of one live update. Prints figures (docs/benchmarks.md).

    python -m bench.console_bench [--waiting 10000] [--runs 5] [--polls 50]

Starts `gpulane serve` in front of a fake upstream, holds the GPU with one
request that never ends, and queues `--waiting` durable jobs (`Prefer:
respond-async`, mixed bands) behind it. Then:

- first paint: headless Chromium (the browser tests' Debian chromium) opens
  /ui/ in a fresh context; the figure is milliseconds from navigation start
  until the first page of waiting rows (100) is in the DOM, median of --runs,
  with the browser's first-contentful-paint beside it;
- live update cost: --polls sequential GETs of the page's poll
  (/ui/api/queue?offset=0&limit=100); CPU milliseconds of the gpulane
  process per poll (utime + stime from /proc) and wall milliseconds per poll,
  and the same for GET /api/queue (the whole queue as JSON) for comparison.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from tests.browser.conftest import chromium_path
from tests.e2e.gateway import Gateway, fake_model

BANDS = ("batch", "normal", "interactive")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hold(gw: Gateway) -> None:
    """Hold the GPU with a request that never ends (until gpulane is killed)."""
    body = {"model": "A", "messages": [], "fake": {"hang": True}}
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=None)


def fill(gw: Gateway, waiting: int, bands: tuple[str, ...] = BANDS) -> None:
    def enqueue(i: int) -> None:
        body = {"model": "A", "messages": [{"role": "user", "content": "hi"}]}
        headers = {
            "Prefer": "respond-async",
            "X-LlamaSwap-Priority": bands[i % len(bands)],
            "X-Gpulane-Caller": f"user{i % 7}",
        }
        client.post("/v1/chat/completions", json=body, headers=headers).raise_for_status()

    with (
        httpx.Client(
            base_url=gw.url, timeout=60, limits=httpx.Limits(max_connections=16)
        ) as client,
        cf.ThreadPoolExecutor(16) as pool,
    ):
        list(pool.map(enqueue, range(waiting)))


def poll_cost(gw: Gateway, path: str, polls: int) -> tuple[float, float]:
    """(CPU ms of gpulane per poll, wall ms per poll)."""
    assert gw.proc is not None
    with httpx.Client(base_url=gw.url, timeout=60) as client:
        client.get(path).raise_for_status()  # warm: run times cached, code paths hot
        cpu0, t0 = _cpu_s(gw.proc.pid), time.perf_counter()
        for _ in range(polls):
            client.get(path).raise_for_status()
        cpu1, t1 = _cpu_s(gw.proc.pid), time.perf_counter()
    return (cpu1 - cpu0) * 1000 / polls, (t1 - t0) * 1000 / polls


def first_paint(gw: Gateway, runs: int) -> tuple[float, float]:
    from playwright.sync_api import sync_playwright

    rows_ms, fcp_ms = [], []
    with sync_playwright() as p:
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        browser = p.chromium.launch(executable_path=chromium_path(), args=args)
        for _ in range(runs):
            context = browser.new_context()
            page = context.new_page()
            page.goto(gw.url + "/ui/")
            # A selector, not a predicate: the console's CSP forbids eval.
            page.wait_for_selector("#waiting-table tbody tr:nth-child(100)", timeout=60_000)
            rows_ms.append(page.evaluate("performance.now()"))
            fcp_ms.append(
                page.evaluate(
                    "performance.getEntriesByName('first-contentful-paint')[0]?.startTime ?? NaN"
                )
            )
            context.close()
        browser.close()
    return statistics.median(rows_ms), statistics.median(fcp_ms)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiting", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--polls", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # shutdownGrace 0: at the end the hung request is not waited for.
        config = "shutdownGrace: 0\nmodels:" + fake_model("A").replace("\n", "\n  ") + "\n"
        gw = Gateway(Path(tmp), config).start()
        try:
            # A daemon thread: if a step fails, nothing waits for the request that never ends.
            holder = threading.Thread(target=hold, args=(gw,), daemon=True)
            holder.start()
            gw.wait_for("SELECT 1 FROM requests WHERE status = 'running'", timeout=30)
            t0 = time.perf_counter()
            fill(gw, args.waiting)
            print(f"queued {args.waiting} durable jobs in {time.perf_counter() - t0:.1f} s")
            depth = httpx.get(gw.url + "/ui/api/queue?limit=1").json()["total_waiting"]
            assert depth == args.waiting, depth
            rows, fcp = first_paint(gw, args.runs)
            print(
                f"queue page, {depth} waiting: first 100 rows drawn {rows:.0f} ms after "
                f"navigation (first contentful paint {fcp:.0f} ms), median of {args.runs}"
            )
            for path in ("/ui/api/queue?offset=0&limit=100", "/api/queue"):
                cpu, wall = poll_cost(gw, path, args.polls)
                print(
                    f"GET {path}: {cpu:.1f} ms gpulane CPU, {wall:.1f} ms wall per poll "
                    f"({args.polls} polls)"
                )
        finally:
            # SIGTERM, not SIGKILL: gpulane stops its upstreams (a kill would leave
            # the fake upstream running); the waiting jobs stay queued in the
            # temporary database.
            gw.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
