"""Nothing jams the lane: bad input, hung upstreams and stops end every dispatched
request in exactly one terminal event, and the next request is served.

Each test drives one fault through `gpulane serve` as a real process in front of
real (fake) upstream processes, then checks what a user relies on: the answer,
the next request, and `gpulane db check`.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
from collections.abc import Callable

import httpx

from tests.e2e.gateway import (
    Gateway,
    fake_model,
    free_port_block,
    poll,
    raw_request,
    upstreams_alive,
    upstreams_left,
)

Start = Callable[[str], Gateway]
ASYNC = {"Prefer": "respond-async"}


def config(extra: str = "", model_extra: str = "") -> str:
    models = "".join(fake_model(m) + model_extra for m in ("A", "B")).replace("\n", "\n  ")
    serial = "routing:\n  scheduler:\n    settings:\n      serial:\n        swapAffinityBonus: 0\n"
    return f"{serial}{extra}models:{models}\n"


def chat(model: str = "A", stream: bool = False, **fake: object) -> dict[str, object]:
    body: dict[str, object] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if fake:
        body["fake"] = fake
    if stream:
        body["stream"] = True
    return body


def assert_log_sound(gw: Gateway, timeout: float = 30) -> None:
    # A response can arrive just before its last event is group-committed: poll.
    query = "SELECT id, status FROM requests WHERE status IN ('queued', 'running')"
    poll(lambda: not gw.sql(query), "every request to end", timeout)
    check = gw.db_check()
    assert check.returncode == 0, check.stdout + check.stderr
    unfinished = gw.sql("SELECT from_model, to_model FROM swaps WHERE finished_at IS NULL")
    assert [tuple(r) for r in unfinished] == []


def wait_status(gw: Gateway, request_id: str, *statuses: str, timeout: float = 20) -> str:
    rows = gw.wait_for(
        f"SELECT status FROM requests WHERE id = ? AND status IN ({','.join('?' * len(statuses))})",
        request_id,
        *statuses,
        timeout=timeout,
    )
    assert rows, f"{request_id} never reached {statuses}: {gw.sql('SELECT * FROM requests')}"
    return str(rows[0]["status"])


def test_non_ascii_and_padded_header_values_are_forwarded_as_sent(gateway: Start) -> None:
    gw = gateway(config())
    body = json.dumps(chat()).encode()
    head = (
        b"POST /upstream/A/echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + "X-User: José\r\n".encode()
        + b"X-Padded: value \t\r\n"
        + b"Connection: close\r\n"
    )
    status, answer = raw_request(gw, head, body)
    assert status == 200, answer
    echoed = {k.lower(): v for k, v in json.loads(answer)["headers"].items()}
    # http.server decodes header bytes as latin-1: the UTF-8 bytes arrived unchanged.
    assert echoed["x-user"].encode("latin-1") == "José".encode()
    assert echoed["x-padded"] == "value"
    # The same on the OpenAI route, and the lane goes on.
    head = head.replace(b"/upstream/A/echo", b"/v1/chat/completions")
    status, answer = raw_request(gw, head, body)
    assert status == 200, answer
    with gw.client() as client:
        assert client.post("/v1/chat/completions", json=chat("B")).status_code == 200
    assert_log_sound(gw)


def test_durable_job_with_a_non_ascii_header_completes(gateway: Start) -> None:
    gw = gateway(config())
    body = json.dumps(chat(reply="ok")).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + "X-User: Zoë\r\nPrefer: respond-async\r\nConnection: close\r\n".encode()
    )
    status, answer = raw_request(gw, head, body)
    assert status == 202, answer
    job = json.loads(answer)["id"]
    assert wait_status(gw, job, "completed", "failed") == "completed"
    assert_log_sound(gw)


def test_huge_priority_headers_are_normal_priority_and_harm_nobody(gateway: Start) -> None:
    gw = gateway(config())
    values = [str(2**63), "9" * 400, "-" + "9" * 4000, str(2**63 - 1)]
    with cf.ThreadPoolExecutor(8) as pool, gw.client() as client:
        futures = [
            pool.submit(
                client.post,
                "/v1/chat/completions",
                json=chat(),
                headers={"X-LlamaSwap-Priority": v},
            )
            for v in values * 3
        ]
        others = [pool.submit(client.post, "/v1/chat/completions", json=chat("B")) for _ in "abcd"]
        answers = [f.result() for f in futures + others]
        assert [a.status_code for a in answers] == [200] * len(answers)
        assert answers[0].headers["x-gpulane-band"] == "normal"
        assert answers[3].headers["x-gpulane-band"] == "interactive"
        assert client.get("/api/queue").status_code == 200
    assert_log_sound(gw)


def test_a_stream_that_stalls_fails_restarts_the_upstream_and_the_lane_moves_on(
    gateway: Start,
) -> None:
    gw = gateway(config(model_extra="  streamIdleTimeout: 1\n"))
    with gw.client() as client:
        with client.stream(
            "POST", "/v1/chat/completions", json=chat(stream=True, chunk_delay=60)
        ) as r:
            assert r.status_code == 200
            text = b"".join(r.iter_raw()).decode()
        assert "streamIdleTimeout" in text  # told in the stream, as a last SSE event
        rid = r.headers["x-request-id"]
        assert client.post("/v1/chat/completions", json=chat(reply="next")).status_code == 200
    assert wait_status(gw, rid, "failed") == "failed"
    stopped = gw.wait_for("SELECT * FROM processes WHERE stop_reason = 'hung'")
    assert len(stopped) == 1
    assert_log_sound(gw)


def test_no_response_headers_within_the_limit_is_a_504(gateway: Start) -> None:
    gw = gateway(config(model_extra="  timeouts:\n    responseHeader: 1\n"))
    with gw.client() as client:
        r = client.post("/v1/chat/completions", json=chat(hang=True))
        assert r.status_code == 504
        assert "responseHeader" in r.json()["error"]["message"]
        assert client.post("/v1/chat/completions", json=chat()).status_code == 200
    assert_log_sound(gw)


def test_a_run_past_max_run_time_is_failed_and_the_lane_freed(gateway: Start) -> None:
    gw = gateway(config(model_extra="  maxRunTime: 1\n"))
    with gw.client() as client:
        r = client.post("/v1/chat/completions", json=chat(hang=True))
        assert r.status_code == 504
        assert r.json()["error"]["code"] == "upstream_timeout"
        assert client.post("/v1/chat/completions", json=chat("B")).status_code == 200
    assert_log_sound(gw)


def test_an_operator_cancels_a_hung_request_and_the_lane_moves_on(gateway: Start) -> None:
    gw = gateway(config())
    with cf.ThreadPoolExecutor(2) as pool, gw.client() as client:
        hung = pool.submit(client.post, "/v1/chat/completions", json=chat(hang=True))
        rows = gw.wait_for("SELECT id FROM requests WHERE status = 'running'")
        assert rows
        waiting = pool.submit(client.post, "/v1/chat/completions", json=chat("B", reply="mine"))
        gw.wait_for("SELECT id FROM requests WHERE status = 'queued'")
        r = client.delete(f"/api/requests/{rows[0]['id']}")
        assert r.status_code == 200 and r.json()["was"] == "running"
        assert hung.result().status_code == 409
        assert hung.result().json()["error"]["code"] == "request_cancelled"
        assert waiting.result().status_code == 200
        assert client.delete(f"/api/requests/{rows[0]['id']}").status_code == 404
    reason = gw.sql("SELECT cancel_reason FROM requests WHERE id = ?", rows[0]["id"])
    assert reason[0]["cancel_reason"] == "explicit"
    assert_log_sound(gw)


def test_sigterm_lets_running_work_finish_and_answers_waiting_clients(gateway: Start) -> None:
    gw = gateway(config("shutdownGrace: 20\n"))
    # The running request runs until the waiting one was answered: a fixed run
    # could end first on a slow host, and B run before the SIGTERM.
    release = gw.tmp / "release"
    with cf.ThreadPoolExecutor(2) as pool, gw.client() as client:
        running = pool.submit(
            client.post, "/v1/chat/completions", json=chat(hold_file=str(release))
        )
        try:
            assert gw.wait_for("SELECT id FROM requests WHERE status = 'running'")
            waiting = pool.submit(client.post, "/v1/chat/completions", json=chat("B"))
            assert gw.wait_for("SELECT id FROM requests WHERE status = 'queued'")
            assert gw.proc is not None
            gw.proc.send_signal(signal.SIGTERM)
            assert waiting.result(timeout=30).status_code == 503
            assert waiting.result().json()["error"]["code"] == "shutting_down"
        finally:
            release.touch()
        assert running.result().status_code == 200  # finished within the grace
        assert gw.proc.wait(30) == 0
    assert_log_sound(gw)
    swaps = gw.sql("SELECT to_model FROM swaps")
    assert [s["to_model"] for s in swaps] == ["A"]  # no swap to B during the stop


def test_sigterm_requeues_a_streamed_durable_job_without_spending_an_attempt(
    gateway: Start,
) -> None:
    gw = gateway(config("shutdownGrace: 0.5\njobs:\n  maxAttempts: 1\n"))
    with gw.client() as client:
        job = client.post(
            "/v1/chat/completions",
            json=chat(stream=True, reply="a b c d", chunk_delay=2),
            headers=ASYNC,
        ).json()["id"]
        wait_status(gw, job, "running")
        assert gw.proc is not None
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(30) == 0
    # Not waited for: had the stream (8 s, past the 0.5 s grace) run out, the job
    # would be completed, not queued again.
    row = gw.sql("SELECT status, attempt FROM requests WHERE id = ?", job)[0]
    assert (row["status"], row["attempt"]) == ("queued", 1)
    gw.start()
    with gw.client() as client:
        assert wait_status(gw, job, "completed", "failed", timeout=30) == "completed"
        view = client.get(f"/v1/jobs/{job}").json()
        assert view["attempt"] == 1
    gw.stop()
    assert_log_sound(gw)


def test_concurrent_posts_with_one_idempotency_key_make_one_job(gateway: Start) -> None:
    gw = gateway(config())
    headers = ASYNC | {"Idempotency-Key": "k-1"}
    with cf.ThreadPoolExecutor(10) as pool, httpx.Client(base_url=gw.url, timeout=30) as client:
        futures = [
            pool.submit(client.post, "/v1/chat/completions", json=chat(), headers=headers)
            for _ in range(10)
        ]
        answers = [f.result() for f in futures]
    assert sorted(a.status_code for a in answers) == [200] * 9 + [202]
    assert len({a.json()["id"] for a in answers}) == 1
    assert len(gw.sql("SELECT id FROM requests")) == 1


def test_after_a_sigkill_recovery_stops_what_an_upstream_left_in_a_new_session(
    gateway: Start,
) -> None:
    # Found by tests/e2e/test_chaos.py: a daemonized copy (fork, setsid, fork)
    # outlives the SIGKILL and the recovery that stops its parent, keeps the
    # model's port, and every later start of that model fails.
    start_port = free_port_block()
    models = fake_model("A", "--spawn-setsid-child").replace("\n", "\n  ")
    gw = gateway(f"startPort: {start_port}\nmodels:{models}\n")
    try:
        with gw.client() as client:
            assert client.post("/v1/chat/completions", json=chat()).status_code == 200
        assert len(upstreams_alive(start_port, 10)) == 2  # the server and its copy
        gw.kill()
        gw.start()
        with gw.client() as client:
            r = client.post("/v1/chat/completions", json=chat())
            assert r.status_code == 200, r.text
        gw.stop()
    finally:
        left = upstreams_left(start_port, 10)
    assert left == {}
