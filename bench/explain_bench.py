"""How long `explain` takes at the end of a long server run under the memory router.

    python -m bench.explain_bench [--requests N] [--repeat R]

A run-loop history on fake upstreams (tests/unit/run_loop_fakes.py, a fake clock):
three models of 30 GiB under an 80 GiB budget, asked in turn A, B, C, so every
request loads its model and evicts one; each ends before the next arrives. The
log is written to a SQLite file and the last request explained `--repeat` times:
explain folds the swap and process events since the server started (under a
router a model loaded long before may be resident still), so its cost grows
with the run's swaps. Prints the median time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from app.report.explain import explain
from app.runtime.parameters import server_started
from app.store.engine import open_database
from tests.unit.run_loop_fakes import T0_NS, Lane, config_text, settle
from tools.replay.generate import write_log

SIZE = {"gpuMemory": "30GiB"}
ROUTER = {"use": "memory", "settings": {"memory": {"budget": "80GiB"}}}


async def history(requests: int) -> tuple[Lane, str]:
    lane = Lane(config_text({"A": SIZE, "B": SIZE, "C": SIZE}, router=ROUTER))
    last = ""
    for i in range(requests):
        ticket = lane.admit("ABC"[i % 3])
        await settle()
        await lane.clock.advance(1)
        await lane.finish(ticket)
        last = ticket.request_id
    return lane, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    lane, last = asyncio.run(history(args.requests))
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "explain.db"
        events = [server_started(lane.config, T0_NS, 0), *lane.events()]
        write_log(db, events)
        engine = open_database(db)
        try:
            times = []
            for _ in range(args.repeat):
                began = time.perf_counter()
                story = explain(engine, last)
                times.append(time.perf_counter() - began)
            assert story is not None and story.replay_matches, story
        finally:
            engine.dispose()
    swaps = sum(1 for e in events if type(e).__name__ == "SwapStarted")
    print(
        f"{args.requests} requests, {len(events)} events, {swaps} swaps: "
        f"explain of the last {statistics.median(times) * 1000:.1f} ms (median of {args.repeat})"
    )


if __name__ == "__main__":
    main()
