"""PostgreSQL against SQLite, side by side in one run. Prints figures; asserts nothing.

    .venv/bin/python -m bench.pg_bench [--seconds 5] [--queued 500] [--rounds 3]
                                       [--events 300000] [--jobs 100000] [--skip ...]

A throwaway PostgreSQL cluster on this machine (tests/postgres.py, fsync on, so
a commit is as durable as SQLite's `synchronous: full`), reached over its unix
socket; SQLite files in a temp dir on the same disk. Each part runs on both,
interleaved per round; medians over --rounds, and the median of the rounds'
ratios PostgreSQL / SQLite.

1. events: bench/event_store_bench.py's load on a new database (64 producers
   as fast as commits allow): events/s.
2. gap: bench/proxy_bench.py's dispatch gap: `gpulane serve` with --queued
   clients queued for one model behind a held request, then drained one at a
   time; request_completed -> next request_started, p50 and p99 in ms.
3. recovery: bench/recovery_bench.py's database of --events events whose last
   --jobs are open durable jobs (built once, cached); `gpulane serve` on a copy
   (SQLite: the file; PostgreSQL: `gpulane db copy` once into a template
   database, then CREATE DATABASE ... TEMPLATE per round), seconds from spawn
   to the first new interactive request answered.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from bench import event_store_bench, proxy_bench, recovery_bench
from tests.postgres import SUPERUSER, Cluster


def _admin(cluster: Cluster, sql: str) -> None:
    with psycopg.connect(
        host=str(cluster.data), port=cluster.port, user=SUPERUSER, dbname="postgres",
        autocommit=True,
    ) as conn:  # fmt: skip
        conn.execute(sql)


def _ratio(pg: list[float], sqlite: list[float]) -> str:
    """The median of the rounds' ratios: each round ran both side by side."""
    return f"{statistics.median(p / s for p, s in zip(pg, sqlite, strict=True)):.2f}"


def events_per_second(cluster: Cluster, tmp: Path, seconds: float) -> list[float]:
    got = []
    for label, db in (("sqlite   ", str(tmp / "events.db")), ("postgres ", cluster.new_database())):
        got.append(asyncio.run(event_store_bench.run(db, "full", seconds, 64, None, label)))
        if db.endswith(".db"):
            recovery_bench._remove(Path(db))
    return got


def dispatch_gap(cluster: Cluster, tmp: Path, queued: int) -> list[tuple[float, float]]:
    got = []
    for label, db in (("sqlite", str(tmp / "gap.db")), ("postgres", cluster.new_database())):
        upstream = proxy_bench.free_port()
        proc, port = proxy_bench.start_gpulane(tmp, upstream, "full", db)
        try:
            # The first request loads the model; then the queue drains on a resident one.
            conn = proxy_bench.Conn(port)
            chat = proxy_bench.json.dumps(proxy_bench.CHAT).encode()
            conn.call(proxy_bench.request_bytes(port, "/v1/chat/completions", chat))
            conn.close()
            since = time.time()
            asyncio.run(proxy_bench.dispatch_gap(port, queued))
            proxy_bench.wait_db_quiet(db, queued, since)
            gaps = proxy_bench.gaps_from_events(db, since)
        finally:
            proxy_bench.stop(proc)
        if db.endswith(".db"):
            recovery_bench._remove(Path(db))
        p50, p99 = proxy_bench.pct(gaps, 50), proxy_bench.pct(gaps, 99)
        print(f"  gap {label:8} {len(gaps)} gaps p50 {p50:.3f} ms p99 {p99:.3f} ms", flush=True)
        got.append((p50, p99))
    return got


def recovery(
    cluster: Cluster, source: Path, template: str, work: Path, config: Path
) -> list[float]:
    got = []
    run = recovery_bench.serve_once(source, work, config)
    got.append(run.first_s)
    name = f"run_{os.getpid()}_{time.monotonic_ns()}"
    _admin(cluster, f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    try:
        run_pg = recovery_bench.serve_once(source, work, config, url=cluster.url(name))
    finally:
        _admin(cluster, f'DROP DATABASE "{name}" WITH (FORCE)')
    got.append(run_pg.first_s)
    print(
        f"  recovery first request: sqlite {run.first_s:.2f} s, postgres {run_pg.first_s:.2f} s "
        f"(recovered {run.recovered_s or 0:.2f} / {run_pg.recovered_s or 0:.2f} s; "
        f"{run_pg.recovery.get('resumed', 0)} resumed)",
        flush=True,
    )
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="event store load per run")
    parser.add_argument("--queued", type=int, default=500, help="clients queued for the gap")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--events", type=int, default=300_000, help="recovery: events in all")
    parser.add_argument("--jobs", type=int, default=100_000, help="recovery: open durable jobs")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    cache = Path(os.environ.get("GPULANE_BENCH_DIR") or tempfile.gettempdir()) / "gpulane-bench"
    cache.mkdir(parents=True, exist_ok=True)
    print(
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; PostgreSQL "
        f"(throwaway cluster, fsync on, unix socket) against SQLite (synchronous full); "
        f"median of {args.rounds} rounds, interleaved",
        flush=True,
    )
    with Cluster.started(fsync=True) as cluster, tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        results: dict[str, list[list[float]]] = {}
        source = template = None
        work = tmp / "recovery"  # its own config.yaml: the gap's is in tmp
        work.mkdir()
        config = work / "config.yaml"
        if "recovery" not in skip:
            config.write_text(recovery_bench.config_text())
            source = recovery_bench.database(args.events, args.jobs, cache)
            template = "recovery_template"
            _admin(cluster, f'CREATE DATABASE "{template}"')
            t0 = time.perf_counter()
            copied = recovery_bench.subprocess.run(
                [sys.executable, "-m", "app.cli", "db", "copy", str(source), cluster.url(template)],
                cwd=recovery_bench.REPO, capture_output=True, text=True,
            )  # fmt: skip
            if copied.returncode != 0:
                raise RuntimeError(copied.stderr)
            print(f"db copy into PostgreSQL: {time.perf_counter() - t0:.0f} s: {copied.stdout}")
        for _ in range(args.rounds):
            if "events" not in skip:
                results.setdefault("events/s", []).append(
                    events_per_second(cluster, tmp, args.seconds)
                )
            if "gap" not in skip:
                (s50, s99), (p50, p99) = dispatch_gap(cluster, tmp, args.queued)
                results.setdefault("gap p50 ms", []).append([s50, p50])
                results.setdefault("gap p99 ms", []).append([s99, p99])
            if source is not None and template is not None:
                results.setdefault("recovery s", []).append(
                    recovery(cluster, source, template, work, config)
                )
        print(
            f"\nmedians; pg/sqlite: the median of each round's ratio\n"
            f"{'figure':32} {'sqlite':>10} {'postgres':>10} {'pg/sqlite':>10}"
        )
        for name, rounds in results.items():
            sqlite = [r[0] for r in rounds]
            pg = [r[1] for r in rounds]
            if name == "recovery s":
                name = f"recovery {args.jobs // 1000}k open: first req s"
            print(
                f"{name:32} {statistics.median(sqlite):10.3f} {statistics.median(pg):10.3f} "
                f"{_ratio(pg, sqlite):>10}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
