"""Throughput and durable-append latency of the event store. Prints figures; asserts nothing.

    .venv/bin/python bench/event_store_bench.py [--seconds 5] [--producers 64] [--dir /tmp]

For each `synchronous` setting, on a fresh file: many producer tasks each play
requests through their life (enqueue, scores_computed, dispatched, started,
completed; every 20th request also a swap with its process start/stop), as the
run loop would: `submit` without waiting, awaiting only the request's last
group. Meanwhile one probe task times durable `append([RequestEnqueued])`
calls, the call an async job's admission makes, under that load.

The CPU time per event (all threads) is printed too: unlike events/s it does
not depend on what else the machine is doing.

Two runs per setting: "max", producers as fast as commits allow (throughput),
and "paced", producers together offering the target rate (20,000 events/s
for full, 50,000 for normal), which is the load the latency target is for.

`--serial N`: instead, one request at a time, each of its three groups
(enqueue with its dispatch, started, completed) awaited before the next, with
the lease's fence on every transaction as `gpulane serve` has it: the CPU a
commit costs when nothing shares it (the proxy's one-request-at-a-time case).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import tempfile
import time
from pathlib import Path

import uvloop

from app.core import events as ev
from app.core.scoring import Breakdown
from app.store import lease
from app.store.engine import Synchronous, open_database
from app.store.event_store import SqlEventStore, last_seq

SWAP_EVERY = 20
EVENTS_PER_REQUEST = 5 + 4 / SWAP_EVERY
TARGET_RATE = {"full": 20_000, "normal": 50_000}
_BREAKDOWN = Breakdown(priority=0, affinity=10, aging=1.5, total=11.5)


def _enqueued(rid: str, now: int) -> ev.RequestEnqueued:
    return ev.RequestEnqueued(
        at=now,
        request_id=rid,
        model="qwen-7b",
        model_requested="qwen",
        endpoint="/v1/chat/completions",
        priority=0,
        band="normal",
        caller="bench",
    )


async def _producer(store: SqlEventStore, name: str, stop: float, interval: float | None) -> None:
    n = 0
    due = time.perf_counter()
    while time.perf_counter() < stop:
        if interval is not None:
            due += interval
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
        n += 1
        rid = f"{name}-{n}"
        now = time.time_ns()
        store.submit([_enqueued(rid, now)])
        store.submit(
            [
                ev.ScoresComputed(
                    at=now, request_id=rid, queue_depth=3, resident="qwen-7b", winner=_BREAKDOWN
                ),
                ev.RequestDispatched(at=now, request_id=rid, model="qwen-7b"),
            ]
        )
        if n % SWAP_EVERY == 0:
            store.submit(
                [
                    ev.SwapStarted(at=now, from_model="llama", to_model="qwen-7b", request_id=rid),
                    ev.ProcessStopped(at=now, model="llama", pid=1000 + n, reason="evicted"),
                    ev.ProcessStarted(
                        at=now, model="qwen-7b", pid=2000 + n, cmdline=["llama-server", "-m", "q"]
                    ),
                    ev.SwapFinished(at=now, model="qwen-7b", duration_ms=2500.0),
                ]
            )
        store.submit([ev.RequestStarted(at=now, request_id=rid)])
        await store.submit(
            [
                ev.RequestCompleted(
                    at=now,
                    request_id=rid,
                    http_status=200,
                    bytes=2048,
                    ttfb_ms=35.0,
                    run_ms=900.0,
                    input_tokens=120,
                    output_tokens=300,
                    tokens_per_second=333.0,
                )
            ]
        )


async def _probe(store: SqlEventStore, stop: float, latencies: list[float]) -> None:
    n = 0
    while time.perf_counter() < stop:
        n += 1
        event = _enqueued(f"probe-{n}", time.time_ns())
        t0 = time.perf_counter()
        await store.append([event])
        latencies.append((time.perf_counter() - t0) * 1000)
        await asyncio.sleep(0.002)


async def run(
    path: Path | str,
    synchronous: Synchronous,
    seconds: float,
    producers: int,
    rate: int | None,
    label: str = "",
) -> float:
    """One load run on a fresh database (a path or URL); `rate` None means as fast
    as it goes. Prints its line (after `label`); returns events/s."""
    interval = None if rate is None else producers * EVENTS_PER_REQUEST / rate
    engine = open_database(path, synchronous=synchronous)
    store = SqlEventStore(engine)
    store.start()
    latencies: list[float] = []
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    stop = t0 + seconds
    await asyncio.gather(
        _probe(store, stop, latencies),
        *(_producer(store, f"p{i}", stop, interval) for i in range(producers)),
    )
    await store.close()
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    events = last_seq(engine)
    engine.dispose()
    lat = sorted(latencies)
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
    load = "max" if rate is None else f"paced {rate:,}/s"
    print(
        f"{label}synchronous={synchronous:6} {load:15} producers={producers} "
        f"{events / elapsed:7,.0f} events/s "
        f"({events:,} in {elapsed:.1f}s, {cpu / events * 1e6:.1f} us CPU/event); "
        f"durable append: n={len(lat)} "
        f"p50={statistics.median(lat):.2f} ms p99={p99:.2f} ms max={lat[-1]:.2f} ms",
        flush=True,
    )
    return events / elapsed


async def serial(path: Path, synchronous: Synchronous, requests: int) -> None:
    """One request at a time, three commits each, fenced; prints the CPU per commit."""
    engine = open_database(path, synchronous=synchronous)
    held = lease.acquire(engine, lease.this_process(engine, "127.0.0.1:0"), time.time())
    store = SqlEventStore(engine, fence=functools.partial(lease.fence, held.term))
    store.start()

    async def one(rid: str) -> None:
        now = time.time_ns()
        store.submit([_enqueued(rid, now)])
        scores = ev.ScoresComputed(
            at=now, request_id=rid, queue_depth=1, resident="qwen-7b", winner=_BREAKDOWN
        )
        await store.submit([scores, ev.RequestDispatched(at=now, request_id=rid, model="qwen-7b")])
        await store.submit([ev.RequestStarted(at=now, request_id=rid)])
        done = ev.RequestCompleted(at=now, request_id=rid, http_status=200, bytes=100, run_ms=1.0)
        await store.submit([done])

    for n in range(200):  # warm up: connection, statement cache
        await one(f"warm-{n}")
    cpu0, t0 = time.process_time(), time.perf_counter()
    for n in range(requests):
        await one(f"r{n}")
    cpu, elapsed = time.process_time() - cpu0, time.perf_counter() - t0
    await store.close()
    engine.dispose()
    print(
        f"synchronous={synchronous:6} serial: {cpu / requests / 3 * 1e6:.0f} us CPU per commit, "
        f"{elapsed / requests / 3 * 1e3:.2f} ms per commit ({requests:,} requests, 3 commits each)",
        flush=True,
    )


def main() -> None:
    synchronous: Synchronous
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="load duration per setting")
    parser.add_argument("--producers", type=int, default=64, help="concurrent producer tasks")
    parser.add_argument("--dir", default="/tmp", help="directory for the temporary database")
    parser.add_argument("--serial", type=int, metavar="N", help="N requests one at a time")
    args = parser.parse_args()
    if args.serial:
        for synchronous in ("full", "normal"):
            with tempfile.TemporaryDirectory(dir=args.dir, prefix="gpulane-bench-") as tmp:
                # On uvloop, as `gpulane serve` runs.
                uvloop.run(serial(Path(tmp) / "events.db", synchronous, args.serial))
        return
    for synchronous in ("full", "normal"):
        for rate in (None, TARGET_RATE[synchronous]):
            with tempfile.TemporaryDirectory(dir=args.dir, prefix="gpulane-bench-") as tmp:
                path = Path(tmp) / "events.db"
                asyncio.run(run(path, synchronous, args.seconds, args.producers, rate))


if __name__ == "__main__":
    main()
