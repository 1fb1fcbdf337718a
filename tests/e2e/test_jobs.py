"""Durable jobs and crash recovery, with real processes and SIGKILL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.e2e.gateway import Gateway, fake_model
from tests.e2e.log_replay import assert_log_replays
from tests.processes import parents

Start = Callable[[str], Gateway]
ASYNC = {"Prefer": "respond-async"}


def config(extra: str = "") -> str:
    models = "".join(fake_model(m) for m in ("A", "B")).replace("\n", "\n  ")
    serial = "routing:\n  scheduler:\n    settings:\n      serial:\n        swapAffinityBonus: 0\n"
    return f"{serial}{extra}models:{models}\n"


def submit(
    client: httpx.Client, model: str, priority: str = "normal", **fake: object
) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "fake": fake}
    return client.post(
        "/v1/chat/completions", json=body, headers=ASYNC | {"X-LlamaSwap-Priority": priority}
    )


def wait_status(
    client: httpx.Client, job_id: str, want: str, timeout: float = 20
) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        view = client.get(f"/v1/jobs/{job_id}").json()
        if view.get("status") == want or time.monotonic() > deadline:
            return view
        time.sleep(0.05)


def test_durable_job_is_accepted_then_completed_with_its_result(gateway: Start) -> None:
    gw = gateway(config())
    with gw.client() as client:
        r = submit(client, "A", "interactive", reply="the answer")
        assert r.status_code == 202
        job = r.json()
        assert r.headers["location"] == f"/v1/jobs/{job['id']}"
        assert job["band"] == "interactive"
        view = wait_status(client, job["id"], "completed")
        assert view["status"] == "completed"
        assert view["result"]["http_status"] == 200
        assert view["result"]["body"]["choices"][0]["message"]["content"] == "the answer"
        raw = client.get(f"/v1/jobs/{job['id']}/result")
        assert raw.status_code == 200
        assert raw.json()["choices"][0]["message"]["content"] == "the answer"
        listed = client.get("/v1/jobs", params={"status": "completed"}).json()["data"]
        assert [j["id"] for j in listed] == [job["id"]]


def test_queued_job_reports_its_position_and_can_be_cancelled(gateway: Start) -> None:
    gw = gateway(config())
    with gw.client() as client:
        # Runs until cancelled below: a short run could end during the checks.
        long = submit(client, "A", delay=30).json()["id"]
        wait_status(client, long, "running")
        first = submit(client, "A", "batch").json()
        second = submit(client, "A", "interactive").json()
        # The 202 has no place: finding it walks the queue (docs/jobs.md).
        assert first["status"] == "queued" and "position" not in first
        view = client.get(f"/v1/jobs/{first['id']}").json()
        assert view["status"] == "queued" and view["position"] == 1
        assert client.get(f"/v1/jobs/{second['id']}").json()["position"] == 0
        assert view["score"]["priority"] == -100
        assert client.delete(f"/v1/jobs/{first['id']}").status_code == 200
        assert client.delete(f"/v1/jobs/{first['id']}").status_code == 409
        # A running job is cut off at once, and the lane moves on to the next.
        cancelled = client.delete(f"/v1/jobs/{long}")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        assert wait_status(client, second["id"], "completed")["status"] == "completed"
        assert client.get(f"/v1/jobs/{first['id']}").json()["status"] == "cancelled"
        assert client.get(f"/v1/jobs/{first['id']}/result").status_code == 409
        assert client.get("/v1/jobs/nope").status_code == 404


def test_a_jobs_position_is_its_place_on_the_queue_page(gateway: Start) -> None:
    # b1 beats a1 (15 to 0 + the bonus 10); once the queue has swapped to B for
    # b1, b2 (5 + 10) goes before a1: the next decision ranks a1 second, the
    # queue page (the dispatch rule played forward) b2.
    gw = gateway(config().replace("swapAffinityBonus: 0", "swapAffinityBonus: 10"))
    with gw.client() as client:
        long = submit(client, "A", delay=30).json()["id"]
        wait_status(client, long, "running")
        jobs = {
            name: submit(client, name[0].upper(), p).json()["id"]
            for name, p in (("b1", "15"), ("a1", "0"), ("b2", "5"))
        }
        page = client.get("/api/queue").json()["waiting"]
        on_page = {w["request_id"]: w["position"] - 1 for w in page}
        assert [on_page[jobs[n]] for n in ("b1", "b2", "a1")] == [0, 1, 2]
        for job in jobs.values():
            assert client.get(f"/v1/jobs/{job}").json()["position"] == on_page[job]
        listed = client.get("/v1/jobs", params={"status": "queued"}).json()["data"]
        assert {j["id"]: j["position"] for j in listed} == on_page
        assert client.delete(f"/v1/jobs/{long}").status_code == 200


def test_the_live_queue_comes_in_pages(gateway: Start) -> None:
    gw = gateway(config())
    with gw.client() as client:
        long = submit(client, "A", delay=30).json()["id"]
        wait_status(client, long, "running")
        waiting = [submit(client, "A").json()["id"] for _ in range(5)]  # arrival order
        whole = client.get("/api/queue").json()
        assert [w["request_id"] for w in whole["waiting"]] == waiting
        page = client.get("/api/queue", params={"offset": 1, "limit": 2}).json()
        assert [(w["request_id"], w["position"]) for w in page["waiting"]] == [
            (waiting[1], 2),
            (waiting[2], 3),
        ]
        assert page["total_waiting"] == 5 and page["running"][0]["request_id"] == long
        bad = client.get("/api/queue", params={"limit": 0})
        assert bad.status_code == 400 and "limit 1 to 1000" in bad.json()["error"]["message"]
        assert client.delete(f"/v1/jobs/{long}").status_code == 200


def test_idempotency_key_returns_the_same_job_and_rejects_a_different_body(gateway: Start) -> None:
    gw = gateway(config())
    body = {"model": "A", "messages": [{"role": "user", "content": "once"}]}
    headers = ASYNC | {"Idempotency-Key": "film-shot-17"}
    with gw.client() as client:
        first = client.post("/v1/chat/completions", json=body, headers=headers)
        again = client.post("/v1/chat/completions", json=body, headers=headers)
        other = client.post("/v1/chat/completions", json=body | {"n": 2}, headers=headers)
    assert first.status_code == 202
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    assert other.status_code == 409 and "film-shot-17" in other.json()["error"]["message"]
    assert len(gw.sql("SELECT id FROM requests WHERE idempotency_key='film-shot-17'")) == 1


def test_results_older_than_the_retention_are_pruned_at_start(gateway: Start) -> None:
    gw = gateway(config("jobs:\n  resultRetention: 1s\n"))
    with gw.client() as client:
        job = submit(client, "A").json()["id"]
        assert wait_status(client, job, "completed")["status"] == "completed"
    gw.stop()
    time.sleep(1.2)
    gw.start()
    with gw.client() as client:
        assert client.get(f"/v1/jobs/{job}").json()["status"] == "completed"  # the events stay
        assert client.get(f"/v1/jobs/{job}/result").status_code == 409


def test_sigkill_then_restart_runs_every_durable_job_once_in_score_order(
    gateway: Start, tmp_path: Path
) -> None:
    gw = gateway(config("jobs:\n  maxAttempts: 3\n"))
    # The running job runs until after the SIGKILL (a fixed run could end first on
    # a slow host), and to its end once run again after the restart.
    release = tmp_path / "release"
    with gw.client() as client:
        running = submit(client, "A", hold_file=str(release)).json()["id"]
        assert wait_status(client, running, "running")["status"] == "running"
        queued = {p: submit(client, "B", p).json()["id"] for p in ("-100", "0", "100", "-99", "1")}
        sync = subprocess.Popen(  # a synchronous client waiting in the queue
            [
                sys.executable,
                "-c",
                f"import httpx; httpx.post('{gw.url}/v1/chat/completions', "
                "json={'model': 'A', 'messages': []}, timeout=60)",
            ],
        )
        assert gw.wait_for("SELECT id FROM requests WHERE durable = 0 AND status = 'queued'")
    leftover = json.loads(gw.sql("SELECT data FROM events WHERE type='process_started'")[0]["data"])
    gw.kill()
    sync.kill()
    os.kill(leftover["pid"], 0)  # the upstream outlived gpulane
    release.touch()

    gw.start()
    with gw.client() as client:
        for job in [running, *queued.values()]:
            assert wait_status(client, job, "completed", timeout=60)["status"] == "completed"
    # Stopped by the recovery; an orphan, it may stay a zombie until init reaps it.
    assert leftover["pid"] not in parents(), "the upstream left behind by the crash still runs"
    events = gw.sql("SELECT seq, type, request_id, data FROM events ORDER BY seq")
    _, restart = (e["seq"] for e in events if e["type"] == "server_started")
    stopped = [e for e in events if e["type"] == "process_stopped" and '"recovered"' in e["data"]]
    started = [e for e in events if e["type"] == "process_started" and e["seq"] > restart]
    assert stopped and started and stopped[0]["seq"] < started[0]["seq"]
    # Each job completed exactly once; the interrupted one ran again as attempt 2.
    completions = [e["request_id"] for e in events if e["type"] == "request_completed"]
    assert sorted(completions) == sorted([running, *queued.values()])
    assert gw.sql("SELECT attempt FROM requests WHERE id=?", running)[0]["attempt"] == 2
    # After the restart, score order: the re-queued job (priority 0) keeps its original
    # enqueue time, so it has aged more than the B job at 0 and goes just before it.
    order = [
        e["request_id"] for e in events if e["type"] == "request_dispatched" and e["seq"] > restart
    ]
    b = queued
    assert order == [b["100"], b["1"], running, b["0"], b["-99"], b["-100"]]
    abandoned = gw.sql("SELECT endpoint FROM requests WHERE status='abandoned'")
    assert len(abandoned) == 1
    gw.stop()
    check = gw.db_check()
    assert check.returncode == 0, check.stdout + check.stderr
    # The log alone says what recovery put back: replay and explain reproduce every decision.
    assert assert_log_replays(gw.db) == 1 + len(queued) + 1
