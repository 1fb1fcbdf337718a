"""What one durable submission costs as the queue grows: the 202's path at 1k and
at 100k waiting. Prints figures; asserts nothing.

    .venv/bin/python -m bench.queue_fill_bench [--depths 1000,10000,100000] [--sample 300]

In process, not over HTTP (100k submissions over HTTP take many minutes on a
small host, and the HTTP layer's cost does not depend on the queue): the
scheduler, its SQLite event store (a file on disk, group commit) and the jobs
service as `gpulane serve` wires them (`JobRunner.accept`: the body stored, the
enqueue on disk, the 202's view). Two peer models whose single slots are held by
jobs that never end, so everything else waits. The queue is filled to each depth
by the same path (durable submissions, alternating the two models and the three
bands; 256 at once, so their commits are grouped), and at each depth `--sample`
submissions are timed one by one (CPU and wall, medians). The fill's own rate
is printed too: filling in linear time means a flat cost per submission.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from app.config import parse_config
from app.jobs.durable import JobRequest, Jobs, KeepResult
from app.runtime.api import Admission, Ticket
from app.runtime.log_buffer import LogBuffer
from app.runtime.scheduler import Scheduler
from app.store.engine import open_database
from app.store.event_store import SqliteEventStore

CONFIG = """
maxQueued: 10000000
maxQueuedPerCaller: 10000000
peers:
  box:
    proxy: http://127.0.0.1:{port}
    models: [a, b]
"""
BANDS = (100, 0, -100)
FILL_WAVE = 256
"""Submissions in flight at once while the queue is filled to the next depth."""


class Hanging:
    """The jobs' upstream: a dispatched job never ends, so its slot stays taken."""

    connection_headers: frozenset[str] = frozenset()

    async def send(
        self, ticket: Ticket, base_url: str, job: dict[str, Any], body: bytes, keep: KeepResult
    ) -> None:
        await asyncio.Event().wait()


def _submission(i: int) -> tuple[Admission, JobRequest]:
    model = "box/a" if i % 2 else "box/b"
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": f"n{i}"}]})
    admission = Admission(
        model=model,
        model_requested=model,
        endpoint="/v1/chat/completions",
        priority=BANDS[i % 3],
    )
    request = JobRequest(
        method="POST",
        path="/v1/chat/completions",
        query="",
        body=body.encode(),
        headers={"content-type": "application/json", "prefer": "respond-async"},
    )
    return admission, request


async def _peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The peer's model list, all a peer's load asks for (jobs never reach it)."""
    await reader.readuntil(b"\r\n\r\n")
    body = b'{"object": "list", "data": [{"id": "a"}, {"id": "b"}]}'
    head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
    writer.write(head.encode() + b"connection: close\r\n\r\n" + body)
    await writer.drain()
    writer.close()


async def _run(args: argparse.Namespace, folder: Path) -> None:
    peer = await asyncio.start_server(_peer, "127.0.0.1", 0)
    port = peer.sockets[0].getsockname()[1]
    config = parse_config(CONFIG.format(port=port))
    engine = open_database(str(folder / "gpulane.db"), synchronous=config.database_synchronous)
    store = SqliteEventStore(engine)
    store.start()
    scheduler = Scheduler(config, store, logs=LogBuffer())
    jobs = Jobs(config, scheduler, engine, Hanging())
    depths = sorted(int(d) for d in args.depths.split(","))
    submitted = 0

    async def submit() -> None:
        nonlocal submitted
        admission, request = _submission(submitted)
        submitted += 1
        accepted = await jobs.accept(admission, request)
        assert accepted.fresh

    print(f"durable submissions, {args.sample} timed at each depth (medians), in process")
    print(f"{'queued':>9} {'cpu ms':>8} {'wall ms':>8} {'fill/s':>8}")
    rows: dict[int, float] = {}
    for depth in depths:
        fill_from, t0 = submitted, time.perf_counter()
        while len(scheduler.state.queue) < depth:
            # Many at once, as many clients would: their commits are grouped.
            wave = min(FILL_WAVE, depth - len(scheduler.state.queue))
            await asyncio.gather(*(submit() for _ in range(wave)))
        fill_rate = (submitted - fill_from) / max(time.perf_counter() - t0, 1e-9)
        cpu, wall = [], []
        for _ in range(args.sample):
            c, w = time.process_time(), time.perf_counter()
            await submit()
            cpu.append((time.process_time() - c) * 1000)
            wall.append((time.perf_counter() - w) * 1000)
        rows[depth] = statistics.median(cpu)
        print(f"{depth:>9,} {rows[depth]:>8.3f} {statistics.median(wall):>8.3f} {fill_rate:>8.0f}")
    low, high = depths[0], depths[-1]
    print(f"cost at {high:,} / at {low:,} queued: {rows[high] / rows[low]:.2f}x (cpu medians)")
    await scheduler.drain(0.0)
    await scheduler.shutdown()
    await store.close()
    engine.dispose()
    peer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="1000,10000,100000")
    ap.add_argument("--sample", type=int, default=300)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(_run(args, Path(tmp)))


if __name__ == "__main__":
    main()
