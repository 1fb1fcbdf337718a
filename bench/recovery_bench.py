"""Restart on a long log with a full queue: start-up time and peak memory. Prints figures.

    python -m bench.recovery_bench [--runs 3] [--sizes 5000000:100000,5000000:10000,...]
                                   [--dir DIR] [--verify]

Each size is EVENTS:OPEN_JOBS: a database of EVENTS events whose last OPEN_JOBS
are `request_enqueued` of durable jobs (`Prefer: respond-async`) still queued.
Before them comes realistic completed history, played serially as the serial
scheduler writes it: enqueue, scores_computed, dispatched, started and
completed per request, a swap (swap_started, process_stopped, process_started,
swap_finished) every ~20 requests, some failed, cancelled, rejected and
durable requests, and a clean restart (server_started, recovery_finished)
every 250,000 events. Then the crash: a restart, one durable job running and
one synchronous request waiting when the process died (recovery re-queues the
one and records the other abandoned), and an upstream process left open whose
PID is above PID_MAX_LIMIT, so it can never name a live process.

The history is bulk-inserted (encoded with app.core.events, read models
computed by `_Projection`, a mirror of app/store/read_model.py); `--verify`
builds a small database that way and through the real writer
(event_store.write_events) and checks every table is identical, rowids
included, then runs `gpulane db check` on it. Databases are cached in
$GPULANE_BENCH_DIR (default /tmp/gpulane-bench), keyed by size, generator
version and schema revision.

Each run copies the cached database (serving appends events), starts
`gpulane serve` as a user does and measures, from just before the process is
spawned: (a) until `/health` answers, (b) until a new synchronous interactive
request to a fake upstream (no delay) is answered, which includes loading that
model; and the server's peak RSS (VmHWM) then. The queued jobs are batch and
normal priority on the same model, and the config's agingDivisor is one day
so that however old the cached database is they do not outrank the
interactive request; its maxQueued is above every size, so they do not fill
the queue against it (429). The median of --runs runs is printed per size, with an
empty database as the baseline (interpreter and imports).
"""

from __future__ import annotations

import argparse
import base64
import collections
import datetime
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import sqlalchemy

from app.core import events as ev
from app.core.priority import band_of
from app.core.scoring import NS_PER_S, ScoringParams
from app.store import migrate, tables
from app.store.cursor import driver_cursor
from app.store.engine import database_url, open_database
from app.store.event_store import next_seq, write_events
from app.store.read_model import POSITION_NAME, seconds

REPO = Path(__file__).resolve().parents[1]
GENERATOR_VERSION = 1
"""Bump when the generated content changes, so cached databases are rebuilt."""

MODELS = ("A", "B", "C")
JOB_MODEL = "A"
"""Queued jobs and the timed interactive request all use this model."""
PRIORITIES = (100, 101, 0, 0, 0, 1, -100, -99)
HISTORY_SPAN_NS = 30 * 86_400 * NS_PER_S
RESTART_EVERY = 250_000
SWAP_EVERY = 20
IMPOSSIBLE_PID = 2**22 + 4242
"""Above the kernel's PID_MAX_LIMIT (2**22): no live process has it."""
PARAMS = ScoringParams(aging_divisor_ns=60 * NS_PER_S, swap_affinity_bonus=10)
CRASH_TAIL = 10
"""Events between the history and the queued jobs (restart, running job, waiting request)."""
DEFAULT_SIZES = "5000000:100000,5000000:10000,1000000:100000"
_json = msgspec.json.Encoder()


# -- the event stream ----------------------------------------------------------


def _cmdline(model: str) -> list[str]:
    return ["/opt/llama.cpp/llama-server", "-m", f"/models/{model}.gguf", "--port", "5800"]


def job_payload(n: int, model: str, priority: str) -> dict[str, Any]:
    """What JobRunner.accept stores for a chat completion sent with Prefer: respond-async."""
    body = json.dumps(
        {
            "model": model,
            "messages": [
                {"role": "system", "content": "You describe film shots for a render queue."},
                {"role": "user", "content": f"Describe shot {n:06d}: wide, dusk, slow dolly in."},
            ],
            "max_tokens": 256,
            "fake": {"delay": 0},
        }
    ).encode()
    return {
        "method": "POST",
        "path": "/v1/chat/completions",
        "query": "",
        "headers": {
            "host": "127.0.0.1:8080",
            "user-agent": "python-httpx/0.27.0",
            "accept": "*/*",
            "accept-encoding": "gzip, deflate",
            "content-type": "application/json",
            "content-length": str(len(body)),
            "x-llamaswap-priority": priority,
        },
        "body": base64.b64encode(body).decode(),
        "body_sha256": hashlib.sha256(body).hexdigest(),
    }


class _Generator:
    """The events of one database, in seq order (deterministic for a size)."""

    def __init__(self, n_events: int, n_jobs: int, end_ns: int, restart_every: int) -> None:
        if n_events < n_jobs + CRASH_TAIL + 100:
            raise ValueError(f"{n_events} events is too few for {n_jobs} open jobs")
        self.n_events = n_events
        self.n_jobs = n_jobs
        self.restart_every = restart_every
        self.rng = random.Random(n_events * 1_000_003 + n_jobs)
        self.budget = n_events - n_jobs - CRASH_TAIL
        # History ends a little before the jobs are submitted.
        self.t = end_ns - HISTORY_SPAN_NS - n_jobs * 5_000_000
        self.step = HISTORY_SPAN_NS // self.budget
        self.resident: str | None = None
        self.pid: int = 0
        self.next_pid = IMPOSSIBLE_PID
        self.count = 0
        self.since_restart = 0

    def tick(self, scale: float = 1.0) -> int:
        self.t += int(self.step * scale * (0.5 + self.rng.random()))
        return self.t

    def new_id(self) -> str:
        return f"{self.rng.getrandbits(128):032x}"

    def __iter__(self) -> Iterator[ev.AnyEvent]:
        model = MODELS[0]
        n = 0
        while True:
            batch: list[ev.AnyEvent] = []
            if self.since_restart >= self.restart_every:
                batch += self.restart()
            if n % SWAP_EVERY == SWAP_EVERY - 1:
                model = self.rng.choice([m for m in MODELS if m != model])
            batch += self.request(n, model)
            # Keep one event for the final shutdown stop of the resident process.
            if self.count + len(batch) + 1 > self.budget:
                break
            n += 1
            self.count += len(batch)
            self.since_restart += len(batch)
            yield from batch
        reserve = 1 if self.resident is not None else 0
        while self.count < self.budget - reserve:
            self.count += 1
            yield self.rejected()
        if self.resident is not None:
            self.count += 1
            yield self.stop("shutdown")
        assert self.count == self.budget
        yield from self.crash_tail()
        for i in range(self.n_jobs):
            priority = 0 if i % 5 == 4 else -100
            self.t += 5_000_000
            yield ev.RequestEnqueued(
                at=self.t,
                request_id=self.new_id(),
                model=JOB_MODEL,
                model_requested=JOB_MODEL,
                endpoint="/v1/chat/completions",
                priority=priority,
                band=band_of(priority),
                durable=True,
                caller="render-farm",
                job=job_payload(i, JOB_MODEL, str(priority)),
            )

    def stop(self, reason: ev.StopReason) -> ev.ProcessStopped:
        assert self.resident is not None
        event = ev.ProcessStopped(
            at=self.tick(0.01), model=self.resident, pid=self.pid, reason=reason, exit_code=0
        )
        self.resident = None
        return event

    def restart(self) -> list[ev.AnyEvent]:
        self.since_restart = 0
        out: list[ev.AnyEvent] = [self.stop("shutdown")] if self.resident is not None else []
        at = self.tick()
        return [
            *out,
            ev.ServerStarted(
                at=at,
                version="0.1.0",
                config_hash="bench",
                scheduler="serial",
                aging_divisor_ns=PARAMS.aging_divisor_ns,
                swap_affinity_bonus=PARAMS.swap_affinity_bonus,
                pid=12345,
            ),
            ev.RecoveryFinished(at=at + 1_000_000),
        ]

    def rejected(self) -> ev.RequestRejected:
        return ev.RequestRejected(
            at=self.tick(),
            request_id=self.new_id(),
            endpoint="/v1/chat/completions",
            http_status=400,
            error="request body is not valid JSON",
            caller="alice",
        )

    def enqueued(self, rid: str, model: str, priority: int, durable: bool, n: int) -> Any:
        return ev.RequestEnqueued(
            at=self.tick(),
            request_id=rid,
            model=model,
            model_requested=model.lower() if n % 3 == 0 else model,
            endpoint="/v1/chat/completions",
            priority=priority,
            band=band_of(priority),
            durable=durable,
            caller=("alice", "bob", "render-farm")[n % 3],
            idempotency_key=f"key-{rid[:12]}" if durable and n % 2 else None,
            job=job_payload(n, model, str(priority)) if durable else None,
        )

    def request(self, n: int, model: str) -> list[ev.AnyEvent]:
        rng = self.rng
        rid = self.new_id()
        fate = rng.random()
        if fate < 0.005:
            return [self.rejected()]
        priority = rng.choice(PRIORITIES)
        enq = self.enqueued(rid, model, priority, rng.random() < 0.05, n)
        if fate < 0.015:
            return [enq, ev.RequestCancelled(at=self.tick(), request_id=rid, reason="client_gone")]
        out: list[ev.AnyEvent] = [enq, *self.dispatch(enq)]
        if fate < 0.025:
            out.append(
                ev.RequestFailed(
                    at=self.tick(),
                    request_id=rid,
                    error="upstream closed the connection",
                    http_status=502,
                )
            )
            return out
        at = self.tick(2.0)
        run_ms = round(rng.uniform(200, 20_000), 3)
        out_tokens = rng.randint(10, 800)
        out.append(
            ev.RequestCompleted(
                at=at,
                request_id=rid,
                http_status=200,
                bytes=rng.randint(400, 9000),
                ttfb_ms=round(rng.uniform(20, 900), 3),
                run_ms=run_ms,
                input_tokens=rng.randint(20, 4000),
                output_tokens=out_tokens,
                tokens_per_second=out_tokens / run_ms * 1000,
            )
        )
        return out

    def dispatch(self, enq: ev.RequestEnqueued, pid: int | None = None) -> list[ev.AnyEvent]:
        """scores_computed, dispatched, any swap, started."""
        rng = self.rng
        now = self.tick(0.2)
        resident = self.resident
        winner = PARAMS.breakdown(enq.priority, enq.at, now, enq.model == resident)
        swap = enq.model != resident
        runner = None if rng.random() < 0.6 else self.new_id()
        out: list[ev.AnyEvent] = [
            ev.ScoresComputed(
                at=now,
                request_id=enq.request_id,
                queue_depth=0 if runner is None else rng.randint(1, 6),
                resident=resident,
                winner=winner,
                runner_up_id=runner,
                runner_up=None if runner is None else PARAMS.breakdown(0, enq.at, now, False),
                without_aging_id=enq.request_id,
                without_affinity_id=enq.request_id,
                aging_divisor_ns=PARAMS.aging_divisor_ns,
                swap_affinity_bonus=PARAMS.swap_affinity_bonus,
                scheduler="serial",
                config_hash="bench",
            ),
            ev.RequestDispatched(
                at=now, request_id=enq.request_id, model=enq.model, attempt=1, swap=swap
            ),
        ]
        if swap:
            started = self.tick(0.1)
            out.append(
                ev.SwapStarted(
                    at=started, from_model=resident, to_model=enq.model, request_id=enq.request_id
                )
            )
            if resident is not None:
                out.append(self.stop("evicted"))
            self.next_pid += 1
            self.pid = self.next_pid if pid is None else pid
            self.resident = enq.model
            out.append(
                ev.ProcessStarted(
                    at=self.tick(0.1),
                    model=enq.model,
                    pid=self.pid,
                    cmdline=_cmdline(enq.model),
                    port=5800,
                )
            )
            done = self.tick(0.5)
            out.append(
                ev.SwapFinished(at=done, model=enq.model, duration_ms=(done - started) / 1e6)
            )
        out.append(ev.RequestStarted(at=self.tick(0.1), request_id=enq.request_id))
        return out

    def crash_tail(self) -> Iterator[ev.AnyEvent]:
        """A restart, then a durable job running and a sync request waiting at the crash."""
        events = self.restart()
        self.since_restart = 0
        running = self.enqueued(self.new_id(), JOB_MODEL, 0, True, 7)
        events += [running, *self.dispatch(running, pid=IMPOSSIBLE_PID)]
        events.append(self.enqueued(self.new_id(), JOB_MODEL, 100, False, 8))
        assert len(events) == CRASH_TAIL, len(events)
        yield from events


# -- writing it -----------------------------------------------------------------

_REQUEST_COLUMNS = [c.name for c in tables.requests.c]
_INSERT_REQUEST = (
    f"INSERT INTO requests ({', '.join(_REQUEST_COLUMNS)}) "
    f"VALUES ({', '.join(':' + c for c in _REQUEST_COLUMNS)})"
)
_PROCESS_COLUMNS = [c.name for c in tables.processes.c]
_SWAP_COLUMNS = [c.name for c in tables.swaps.c]
_OPEN = ("queued", "running")


def _insert(table: str, columns: list[str]) -> str:
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


class _Projection:
    """app/store/read_model.py's effect on the tables, computed in memory for the
    events the generator writes (a serial log; no retries), then bulk-inserted."""

    def __init__(self, cur: sqlite3.Cursor) -> None:
        self.cur = cur
        self.requests: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self.processes: dict[int, list[Any]] = {}
        self.open_processes: dict[tuple[int, str], list[Any]] = {}
        self.swaps: dict[int, list[Any]] = {}
        self.open_swaps: dict[str, list[Any]] = {}
        self.last = 0

    def apply(self, seq: int, e: ev.AnyEvent) -> None:
        self.last = seq
        at = seconds(e.at)
        match e:
            case ev.RequestEnqueued():
                row = dict.fromkeys(_REQUEST_COLUMNS)
                row.update(
                    id=e.request_id,
                    model=e.model,
                    model_requested=e.model_requested,
                    endpoint=e.endpoint,
                    priority=e.priority,
                    band=e.band,
                    status="queued",
                    durable=e.durable,
                    attempt=e.attempt,
                    caller=e.caller,
                    idempotency_key=e.idempotency_key,
                    enqueue_seq=seq,
                    enqueued_at=seconds(e.enqueued_at if e.enqueued_at is not None else e.at),
                    job=None if e.job is None else _json.encode(e.job).decode(),
                )
                assert e.request_id not in self.requests
                self.requests[e.request_id] = row
            case ev.RequestRejected():
                row = dict.fromkeys(_REQUEST_COLUMNS)
                row.update(
                    id=e.request_id,
                    model_requested=e.model_requested,
                    endpoint=e.endpoint,
                    priority=e.priority,
                    band=e.band,
                    status="failed",
                    durable=0,
                    attempt=1,
                    caller=e.caller,
                    enqueue_seq=seq,
                    enqueued_at=at,
                    finished_at=at,
                    http_status=e.http_status,
                    error=e.error,
                )
                self.requests[e.request_id] = row
            case ev.ScoresComputed():
                self.requests[e.request_id]["score"] = e.winner.total
            case ev.RequestDispatched():
                row = self.requests[e.request_id]
                row.update(
                    status="running",
                    attempt=e.attempt,
                    dispatched_at=at,
                    queue_wait_ms=(at - row["enqueued_at"]) * 1000.0,
                )
            case ev.RequestStarted():
                self.requests[e.request_id]["started_at"] = at
            case ev.RequestCompleted():
                self._finish(e.request_id, "completed", at, e.run_ms)
                self.requests[e.request_id].update(
                    http_status=e.http_status,
                    bytes=e.bytes,
                    ttfb_ms=e.ttfb_ms,
                    input_tokens=e.input_tokens,
                    output_tokens=e.output_tokens,
                    tokens_per_second=e.tokens_per_second,
                )
            case ev.RequestFailed():
                self._finish(e.request_id, "failed", at, None)
                self.requests[e.request_id].update(error=e.error, http_status=e.http_status)
            case ev.RequestCancelled():
                self._finish(e.request_id, "cancelled", at, None)
                self.requests[e.request_id]["cancel_reason"] = e.reason
            case ev.SwapStarted():
                swap: list[Any] = [seq, e.from_model, e.to_model, e.request_id, at]
                swap += [None, None, None]
                self.swaps[seq] = self.open_swaps[e.to_model] = swap
            case ev.SwapFinished():
                swap = self.open_swaps.pop(e.model)
                swap[5:8] = [at, e.duration_ms, None]
                if swap[3] is not None:
                    self.requests[swap[3]]["swap_ms"] = e.duration_ms
            case ev.ProcessStarted():
                cmdline = _json.encode(e.cmdline).decode()
                proc: list[Any] = [seq, e.model, e.pid, cmdline, e.port, at, None, None, None]
                self.processes[seq] = self.open_processes[(e.pid, e.model)] = proc
            case ev.ProcessStopped():
                proc = self.open_processes.pop((e.pid, e.model))
                proc[6:9] = [at, e.reason, e.exit_code]
            case ev.ServerStarted():
                assert not self.open_swaps, "the generator never restarts mid-swap"
            case ev.RecoveryFinished():
                pass
            case _:
                raise AssertionError(f"the generator does not write {ev.type_name(e)}")

    def _finish(self, rid: str, status: str, at: float, run_ms: float | None) -> None:
        row = self.requests[rid]
        if run_ms is None and row["started_at"] is not None:
            run_ms = (at - row["started_at"]) * 1000.0
        row.update(status=status, finished_at=at, run_ms=run_ms)

    def flush(self, everything: bool = False) -> None:
        """Insert finished rows in arrival order (as the writer would have: rowids match)."""
        rows = []
        while self.requests:
            rid = next(iter(self.requests))
            if not everything and self.requests[rid]["status"] in _OPEN:
                break
            rows.append(self.requests.pop(rid))
        self.cur.executemany(_INSERT_REQUEST, rows)
        if everything:
            self.cur.executemany(_insert("processes", _PROCESS_COLUMNS), self.processes.values())
            self.cur.executemany(_insert("swaps", _SWAP_COLUMNS), self.swaps.values())
            self.cur.execute(
                "INSERT INTO projection_position (name, seq) VALUES (?, ?)",
                (POSITION_NAME, self.last),
            )


_INSERT_EVENT = (
    "INSERT INTO events (seq, at, type, request_id, model, data) VALUES (?, ?, ?, ?, ?, ?)"
)


def write_bulk(path: Path, events: Iterator[ev.AnyEvent], chunk: int = 50_000) -> None:
    """Bulk-insert events and their read models into a new database at `path`."""
    open_database(path).dispose()  # the schema, by the migrations
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = OFF")
    conn.execute("PRAGMA cache_size = -1000000")
    cur = conn.cursor()
    cur.execute("BEGIN IMMEDIATE")
    projection = _Projection(cur)
    seq = next_seq(cur)
    rows = []
    for e in events:
        rows.append(
            (
                seq,
                seconds(e.at),
                ev.type_name(e),
                ev.request_id_of(e),
                ev.model_of(e),
                ev.encode(e).decode(),
            )
        )
        projection.apply(seq, e)
        seq += 1
        if len(rows) >= chunk:
            cur.executemany(_INSERT_EVENT, rows)
            rows = []
            projection.flush()
    cur.executemany(_INSERT_EVENT, rows)
    projection.flush(everything=True)
    cur.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def write_real(path: Path, events: Iterator[ev.AnyEvent], chunk: int = 1000) -> None:
    """The same through gpulane's own writer (event_store.write_events), for --verify."""
    engine = open_database(path)
    pending = iter(events)
    with engine.connect() as conn:
        while batch := [e for _, e in zip(range(chunk), pending, strict=False)]:
            with conn.begin():
                cur = driver_cursor(conn)
                write_events(cur, next_seq(cur), batch)
        conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    engine.dispose()


def _dump(path: Path) -> dict[str, list[Any]]:
    """Every table's rows (rowids included) and the schema, for comparing two databases."""
    conn = sqlite3.connect(path)
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        out = {"schema": conn.execute("SELECT type, name, sql FROM sqlite_master").fetchall()}
        for table in sorted(tables):
            out[table] = conn.execute(f"SELECT rowid, * FROM {table} ORDER BY rowid").fetchall()
        return out
    finally:
        conn.close()


def verify(work: Path) -> bool:
    """Small database both ways: identical tables, and `gpulane db check` passes."""
    n_events, n_jobs, end_ns = 40_000, 2_000, 1_750_000_000 * NS_PER_S
    bulk, real = work / "verify-bulk.db", work / "verify-real.db"
    for path in (bulk, real):
        _remove(path)
    write_bulk(bulk, iter(_Generator(n_events, n_jobs, end_ns, restart_every=7_000)))
    write_real(real, iter(_Generator(n_events, n_jobs, end_ns, restart_every=7_000)))
    a, b = _dump(bulk), _dump(real)
    ok = True
    for table in sorted(a.keys() | b.keys()):
        same = a.get(table) == b.get(table)
        ok &= same
        print(f"verify: {table}: {len(a.get(table, []))} rows, {'identical' if same else 'DIFFER'}")
    check = subprocess.run(
        [sys.executable, "-m", "app.cli", "db", "check", "--db", str(bulk)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    print(f"verify: gpulane db check: {(check.stdout + check.stderr).strip()}")
    ok &= check.returncode == 0
    if ok:
        for path in (bulk, real):
            _remove(path)
    return ok


def _remove(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def database(n_events: int, n_jobs: int, cache: Path) -> Path:
    """The cached database for a size, built on first use."""
    name = f"recovery-{n_events}-{n_jobs}-g{GENERATOR_VERSION}-{migrate.head_revision()}.db"
    path = cache / name
    if not path.exists():
        tmp = cache / f"{name}.tmp"
        _remove(tmp)
        t0 = time.perf_counter()
        write_bulk(tmp, iter(_Generator(n_events, n_jobs, time.time_ns(), RESTART_EVERY)))
        _remove(path)
        os.replace(tmp, path)
        size = path.stat().st_size / 2**20
        print(f"built {path} ({size:.0f} MiB) in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


# -- serving it -----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config_text() -> str:
    models = "".join(
        f"""
          {m}:
            cmd: {sys.executable} -m tools.fake_upstream --port ${{PORT}} --name {m}
            checkEndpoint: /health"""
        for m in MODELS
    )
    return textwrap.dedent(
        f"""\
        startPort: {_free_port()}
        maxQueued: 10000000
        routing:
          scheduler:
            settings:
              serial:
                agingDivisor: 86400
        models:{models}
        """
    )


class Run(msgspec.Struct):
    health_s: float
    first_s: float
    peak_rss_mib: float
    cpu_s: float
    """CPU time (user + system) gpulane used until then: steadier than wall time on a busy box."""
    recovered_s: float | None
    """When the server logged its recovery line (ms resolution; None: nothing to recover)."""
    listening_s: float | None
    """When it logged that it listens (after start-up: recovered jobs handed to JobRunner)."""
    recovery: dict[str, Any]


_LOG_TIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def _logged_at(log: Path, marker: str, spawned: float) -> float | None:
    """Seconds from spawn to the first log line containing `marker`."""
    for line in log.read_text(errors="replace").splitlines():
        if marker in line and (m := _LOG_TIME.search(line)):
            at = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            return at - spawned
    return None


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _wait_health(client: httpx.Client, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gpulane exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if client.get("/health", timeout=1).text == "OK":
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.005)
    raise RuntimeError(f"gpulane did not answer /health:\n{log.read_text()}")


def serve_once(source: Path | None, work: Path, config: Path, url: str | None = None) -> Run:
    """Start `gpulane serve` on a copy of `source` (None: an empty database) and time
    it; or on the database at `url` (a PostgreSQL copy made beforehand)."""
    db: Path | str = url or work / "serve.db"
    if url is None:
        _remove(work / "serve.db")
    if source is not None and url is None:
        shutil.copyfile(source, work / "serve.db")
        # On disk before the clock starts: no writeback of the copy during the run.
        with (work / "serve.db").open("rb+") as f:
            os.fsync(f.fileno())
    log = work / "serve.log"
    port = _free_port()
    body = {"model": JOB_MODEL, "messages": [{"role": "user", "content": "hi"}], "fake": {}}
    with log.open("wb") as out:
        spawned = time.time()
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--config", str(config)]
            + ["--listen", f"127.0.0.1:{port}", "--db", str(db)],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    children: list[int] = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            _wait_health(client, proc, log)
            health = time.perf_counter() - t0
            r = client.post(
                "/v1/chat/completions", json=body, headers={"X-LlamaSwap-Priority": "interactive"}
            )
            first = time.perf_counter() - t0
            if r.status_code != 200 or r.headers.get("x-served-by") != JOB_MODEL:
                raise RuntimeError(f"interactive request: {r.status_code} {r.text}")
            peak = _peak_rss_mib(proc.pid)
            cpu = _cpu_s(proc.pid)
            children = _children(proc.pid)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # gpulane stops its upstreams on SIGTERM; make sure of it (our grandchildren).
        for pid in children:
            try:
                if b"tools.fake_upstream" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass
    engine = sqlalchemy.create_engine(database_url(db))
    with engine.connect() as conn:
        row = conn.exec_driver_sql(
            "SELECT data FROM events WHERE type = 'recovery_finished' ORDER BY seq DESC LIMIT 1"
        ).first()
    engine.dispose()
    recovery = json.loads(row[0]) if row else {}
    recovery.pop("type", None)
    recovery.pop("at", None)
    recovered = _logged_at(log, "gpulane.recovery", spawned)
    listening = _logged_at(log, "listening on", spawned)
    return Run(health, first, peak, cpu, recovered, listening, recovery)


def _median(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{statistics.median(known):5.2f}" if known else "    -"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="EVENTS:OPEN_JOBS,...")
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(os.environ.get("GPULANE_BENCH_DIR") or Path(tempfile.gettempdir()))
        / "gpulane-bench",
        help="where databases are cached (default $GPULANE_BENCH_DIR or /tmp/gpulane-bench)",
    )
    parser.add_argument("--verify", action="store_true", help="check the generator, then exit")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.verify:
        return 0 if verify(args.dir) else 1
    sizes = [tuple(int(x) for x in s.split(":")) for s in args.sizes.split(",")]
    sources: list[tuple[str, Path | None]] = [("empty database", None)]
    sources += [(f"{n:>9,} events {j:>7,} open", database(n, j, args.dir)) for n, j in sizes]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        config = work / "config.yaml"
        config.write_text(config_text())
        print(
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; median of "
            f"{args.runs} runs (interleaved) of gpulane serve, seconds from spawn to: "
            "recovery logged, listening logged, /health answering, first new interactive "
            "request answered (cold load of its model included); gpulane's CPU time and "
            "peak RSS (VmHWM) then",
            flush=True,
        )
        runs: dict[str, list[Run]] = {label: [] for label, _ in sources}
        for _ in range(args.runs):
            for label, source in sources:
                runs[label].append(serve_once(source, work, config))
        print(
            f"{'database':32} {'recovered':>9} {'listening':>9} {'/health':>7} "
            f"{'first req':>9} {'CPU':>5} {'peak RSS':>9}   first req per run; recovery"
        )
        for label, _ in sources:
            got = runs[label]
            rec = got[-1].recovery
            print(
                f"{label:32} {_median([r.recovered_s for r in got]):>9} "
                f"{_median([r.listening_s for r in got]):>9} "
                f"{_median([r.health_s for r in got]):>7} "
                f"{_median([r.first_s for r in got]):>9} "
                f"{_median([r.cpu_s for r in got]):>5} "
                f"{statistics.median(r.peak_rss_mib for r in got):5.0f} MiB   "
                f"{', '.join(f'{r.first_s:.2f}' for r in got)}; "
                f"{rec.get('resumed', 0)} resumed, {rec.get('requeued', 0)} re-queued, "
                f"{rec.get('abandoned', 0)} abandoned, {rec.get('processes_left', 0)} "
                "process left alone",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
