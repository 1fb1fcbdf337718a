"""After SIGKILLs with durable jobs running and queued, the state recovery builds at
start-up is the state obtained by folding the whole log from scratch (DESIGN.md:
the log is the only input of every reader), and the log replays."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from app.config import load_config
from app.core.state import SchedulerState, apply
from app.runtime.log_buffer import LogBuffer
from app.runtime.parameters import server_started
from app.runtime.recovery import recover
from app.runtime.scheduler import Scheduler
from app.store.engine import open_database
from app.store.event_store import SqliteEventStore, read_events
from tests.e2e.gateway import Gateway, fake_model
from tests.e2e.log_replay import assert_log_replays
from tests.unit.core_driver import snapshot

ASYNC = {"Prefer": "respond-async"}


def submit(client: httpx.Client, model: str, priority: str, delay: float) -> str:
    body = {"model": model, "messages": [], "fake": {"delay": delay}}
    headers = ASYNC | {"X-LlamaSwap-Priority": priority}
    r = client.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def a_waiting_synchronous_client(gw: Gateway) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import httpx; httpx.post('{gw.url}/v1/chat/completions', "
            "json={'model': 'A', 'messages': []}, timeout=120)",
        ]
    )


async def recover_as_serve_does(gw: Gateway) -> tuple[Scheduler, SchedulerState]:
    """Start-up as `gpulane serve` runs it (server_started, then recovery) on the
    gateway's database, in this process; and the whole log folded from scratch."""
    config = load_config(gw.config)
    engine = open_database(gw.db)
    store = SqliteEventStore(engine)
    store.start()
    scheduler = Scheduler(config, store, logs=LogBuffer())
    try:
        scheduler.emit([server_started(config, scheduler.clock(), os.getpid())])
        await recover(scheduler, engine, config.max_attempts)
    finally:
        await store.close()
    folded = SchedulerState()
    for _, event in read_events(engine):
        apply(folded, event)
    engine.dispose()
    return scheduler, folded


async def test_recovery_state_equals_the_fold_of_the_whole_log(tmp_path: Path) -> None:
    models = "".join(fake_model(m) for m in ("A", "B")).replace("\n", "\n  ")
    gw = Gateway(tmp_path, f"jobs:\n  maxAttempts: 5\nmodels:{models}\n")
    try:
        gw.start()
        with gw.client() as client:
            first = submit(client, "A", "normal", 60)
            gw.wait_for("SELECT 1 FROM requests WHERE id = ? AND status = 'running'", first)
            jobs = [submit(client, m, p, 60) for m, p in [("B", "batch"), ("A", "1"), ("B", "100")]]
            sync = a_waiting_synchronous_client(gw)
            gw.wait_for("SELECT 1 FROM requests WHERE durable = 0 AND status = 'queued'")
        gw.kill()
        sync.kill()
        # A second process: its recovery restores the jobs and runs the best one; killed
        # again while that one runs and the rest wait.
        gw.start()
        gw.wait_for("SELECT 1 FROM requests WHERE id = ? AND status = 'running'", jobs[2])
        gw.kill()

        scheduler, folded = await recover_as_serve_does(gw)
        assert snapshot(scheduler.state) == snapshot(folded)
        state = folded
        assert state.running == {} and state.resident is None
        assert sorted(state.requests) == sorted([first, *jobs])
        assert set(scheduler.tickets) == set(state.requests)
        assert state.requests[first].attempt == 2  # killed while running, once
        assert state.requests[jobs[2]].attempt == 2
        # Dispatch order: priority, the re-queued jobs aging from their first enqueue.
        order = [q.request_id for q in state.queue.ranked(state.resident)]
        assert order == [jobs[2], jobs[1], first, jobs[0]]
        assert_log_replays(gw.db)
    finally:
        gw.stop()  # SIGKILLed last: stops what it left running, once recovery looked


async def test_without_aging_a_requeued_job_keeps_its_arrival_place(tmp_path: Path) -> None:
    # agingDivisor 0: equal priorities are ordered by arrival alone. The job that was
    # running arrived first, so after a SIGKILL it goes first again, not last.
    models = fake_model("A").replace("\n", "\n  ")
    aging_off = "routing:\n  scheduler:\n    settings:\n      serial:\n        agingDivisor: 0\n"
    gw = Gateway(tmp_path, f"{aging_off}models:{models}\n")
    try:
        gw.start()
        with gw.client() as client:
            first = submit(client, "A", "normal", 60)
            gw.wait_for("SELECT 1 FROM requests WHERE id = ? AND status = 'running'", first)
            later = [submit(client, "A", "normal", 60) for _ in range(2)]
        gw.kill()

        scheduler, folded = await recover_as_serve_does(gw)
        assert snapshot(scheduler.state) == snapshot(folded)
        assert [q.request_id for q in folded.queue.ranked(folded.resident)] == [first, *later]
        # And a real restart runs it first.
        gw.start()
        gw.wait_for("SELECT 1 FROM requests WHERE id = ? AND status = 'running'", first)
        assert gw.sql("SELECT id FROM requests WHERE status = 'running'")[0]["id"] == first
        gw.kill()
        assert_log_replays(gw.db)
    finally:
        gw.stop()  # SIGKILLed last, with A running a job: stops what it left
