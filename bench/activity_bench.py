"""The newest-first request pages (`/v1/activity`, `/v1/jobs`) on a large history.
Prints figures, asserts nothing.

    python -m bench.activity_bench [--requests 1000000]

Builds a database with gpulane's own schema (`open_database`) holding
`--requests` finished requests from 20 callers, plus one rare caller with one
request in 10,000, then times `app.store.queries.activity` (a page of 50,
newest first) for everyone, a frequent caller and the rare one: with the
indexes of migration 0003, and again after dropping them. Best of 5 per figure.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from app.store.engine import open_database
from app.store.queries import activity

INDEXES = ("ix_requests_enqueue_seq", "ix_requests_caller_enqueue_seq")


def _best_ms(run: Callable[[], object], times: int = 5) -> float:
    best = float("inf")
    for _ in range(times):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    args = ap.parse_args()
    rng = random.Random(1)
    with tempfile.TemporaryDirectory() as tmp:
        engine = open_database(Path(tmp) / "gpulane.db")
        t = time.perf_counter()
        rows = (
            (
                f"{i:032x}",
                "llama-8b",
                "/v1/chat/completions",
                "completed",
                "rare" if i % 10_000 == 0 else f"user-{rng.randrange(20)}",
                i,
                1_700_000_000.0 + i,
                1_700_000_001.0 + i,
            )
            for i in range(args.requests)
        )
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO requests (id, model, endpoint, priority, band, status, durable,"
                " attempt, caller, enqueue_seq, enqueued_at, finished_at)"
                " VALUES (?, ?, ?, 0, 'normal', ?, 0, 1, ?, ?, ?, ?)",
                list(rows),
            )
        print(f"{args.requests:,} requests written in {time.perf_counter() - t:.1f} s")
        for label in ("with the indexes of 0003", "without them"):
            cells = []
            for who in ("everyone", "user-3", "rare"):
                caller = None if who == "everyone" else who
                ms = _best_ms(lambda: activity(engine, 50, 0, caller))  # noqa: B023 (called at once)
                cells.append(f"{who} {ms:.1f} ms")
            print(f"page of 50, newest first, {label}: " + ", ".join(cells))
            with engine.begin() as conn:
                for name in INDEXES:
                    conn.exec_driver_sql(f"DROP INDEX IF EXISTS {name}")
        engine.dispose()


if __name__ == "__main__":
    main()
