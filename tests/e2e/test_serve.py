"""gpulane serve as a real process in front of real (fake) upstream processes.

One smoke test per feature through real processes; the scheduling scenarios
(priority, affinity, aging, cancellation, faults) are unit tests of the run
loop in tests/unit/test_scheduler.py."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e.gateway import REPO, Gateway, fake_model

Start = Callable[[str], Gateway]


def chat(
    model: str, priority: str | None = None, **fake: object
) -> tuple[dict[str, object], dict[str, str]]:
    body: dict[str, object] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if fake:
        body["fake"] = fake
    headers = {"X-LlamaSwap-Priority": priority} if priority is not None else {}
    return body, headers


def three_models(**serial: object) -> str:
    settings = "".join(f"        {k}: {v}\n" for k, v in serial.items())
    return (
        "routing:\n  scheduler:\n    use: serial\n    settings:\n      serial:\n"
        + (settings or "        swapAffinityBonus: 10\n")
        + "models:"
        + "".join(fake_model(m) for m in ("A", "B", "C")).replace("\n", "\n  ")
        + "\n"
    )


def wait_started(gw: Gateway) -> None:
    """Until a request runs on its loaded model (nothing else is in flight)."""
    rows = gw.wait_for("SELECT id FROM requests WHERE status='running' AND started_at IS NOT NULL")
    assert rows, f"no request started: {[tuple(r) for r in gw.sql('SELECT * FROM requests')]}"


def wait_queued(gw: Gateway, count: int) -> None:
    rows = gw.wait_for("SELECT id FROM requests WHERE status='queued'", count=count)
    assert len(rows) >= count, f"not {count} queued: {[tuple(r) for r in rows]}"


def post_in_order(gw: Gateway, requests: list[tuple[str, str | None]]) -> list[int]:
    """Send requests one after another (each enqueued before the next) while a
    long job holds the GPU; return their indexes in the order they were dispatched."""
    release = gw.tmp / f"release-{uuid.uuid4().hex}"
    with cf.ThreadPoolExecutor(len(requests) + 1) as pool, gw.client() as client:
        # Held until every request waits: a fixed run could end first on a slow host.
        long_body, _ = chat("A", hold_file=str(release))
        blocker = pool.submit(client.post, "/v1/chat/completions", json=long_body)
        wait_started(gw)
        futures = []
        try:
            for queued, (model, priority) in enumerate(requests, start=1):
                body, headers = chat(model, priority)
                fut = pool.submit(client.post, "/v1/chat/completions", json=body, headers=headers)
                futures.append(fut)
                wait_queued(gw, queued)
            assert not blocker.done(), "the long job ended before every request was queued"
        finally:
            release.touch()
        blocker.result()
        ids = [f.result().headers["x-request-id"] for f in futures]
    # Order of dispatch, from the log (response end times can race by microseconds).
    marks = ",".join("?" * len(ids))
    rows = gw.wait_for(
        f"SELECT id FROM requests WHERE status='completed' AND id IN ({marks})"
        " ORDER BY dispatched_at",
        *ids,
        count=len(ids),
    )
    order = [r["id"] for r in rows]
    assert sorted(order) == sorted(ids)
    return [ids.index(i) for i in order]


def test_chat_completion_through_the_proxy_carries_decision_headers(gateway: Start) -> None:
    gw = gateway(three_models())
    with gw.client() as client:
        body, headers = chat("A", "interactive", reply="hello there")
        r = client.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "hello there"
    assert r.headers["x-served-by"] == "A"
    assert r.headers["x-gpulane-band"] == "interactive"
    assert float(r.headers["x-gpulane-score"]) >= 100
    assert float(r.headers["x-gpulane-queue-wait-ms"]) >= 0
    rows = gw.wait_for(
        "SELECT * FROM requests WHERE id=? AND status='completed'", r.headers["x-request-id"]
    )
    assert rows[0]["priority"] == 100
    assert rows[0]["input_tokens"] is not None and rows[0]["output_tokens"] is not None


def test_openai_client_sends_priority_with_extra_headers_and_streams(gateway: Start) -> None:
    gw = gateway(three_models())
    client = OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="B",
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"X-LlamaSwap-Priority": "batch"},
        extra_body={"fake": {"reply": "from b"}},
    )
    assert reply.choices[0].message.content == "from b"
    stream = client.chat.completions.create(
        model="B",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_headers={"X-LlamaSwap-Priority": "-98"},
        extra_body={"fake": {"reply": "one two three four", "chunks": 4}},
    )
    text = "".join((c.choices[0].delta.content or "") for c in stream if c.choices)
    assert text.replace(" ", "") == "onetwothreefour"
    rows = gw.wait_for(
        "SELECT priority, band FROM requests WHERE status='completed' ORDER BY enqueued_at", count=2
    )
    assert [(r["priority"], r["band"]) for r in rows] == [(-100, "batch"), (-98, "batch")]


def test_streamed_chunks_arrive_as_the_upstream_sends_them(gateway: Start) -> None:
    gw = gateway(three_models())
    body, _ = chat("A", chunks=3, chunk_delay=0.5, reply="a b c")
    body["stream"] = True
    arrivals = []
    with gw.client() as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            if chunk.strip():
                arrivals.append(time.monotonic())
    assert arrivals[-1] - arrivals[0] >= 0.8  # not buffered until the end


def test_mixed_priorities_are_served_by_score_while_a_long_job_runs(gateway: Start) -> None:
    gw = gateway(three_models(swapAffinityBonus=0))
    order = post_in_order(
        gw, [("A", "batch"), ("A", None), ("A", "interactive"), ("A", "101"), ("A", "-99")]
    )
    # 101 > interactive(100) > normal > -99 > batch(-100)
    assert order == [3, 2, 1, 4, 0]


def test_queued_client_that_disconnects_is_cancelled_and_the_queue_moves_on(gateway: Start) -> None:
    gw = gateway(three_models())
    release = gw.tmp / "release"
    with cf.ThreadPoolExecutor(3) as pool, gw.client() as client:
        # Held until the impatient client's cancel is on disk: a fixed run could
        # end first on a slow host, and the impatient request run.
        blocker = pool.submit(
            client.post, "/v1/chat/completions", json=chat("A", hold_file=str(release))[0]
        )
        wait_started(gw)
        try:
            with (
                pytest.raises(httpx.ReadTimeout),
                httpx.Client(base_url=gw.url, timeout=0.3) as impatient,
            ):
                impatient.post("/v1/chat/completions", json=chat("A", "interactive")[0])
            rows = gw.wait_for("SELECT status, error FROM requests WHERE status='cancelled'")
        finally:
            release.touch()
        after = pool.submit(client.post, "/v1/chat/completions", json=chat("A")[0])
        assert blocker.result().status_code == 200
        assert after.result().status_code == 200
    assert len(rows) == 1
    assert len(gw.sql("SELECT 1 FROM requests WHERE status='cancelled'")) == 1
    assert (
        gw.sql("SELECT data FROM events WHERE type='request_cancelled'")[0]["data"].find(
            "client_gone"
        )
        > 0
    )


def test_client_leaving_mid_stream_frees_the_gpu_at_once(gateway: Start) -> None:
    gw = gateway(three_models())
    # The stream's second chunk would come in an hour: if gpulane waited for the
    # upstream after its client left, the next request would never be answered.
    body, _ = chat("A", chunks=2, chunk_delay=3600)
    body["stream"] = True
    with gw.client() as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            next(r.iter_raw())
            first = r.headers["x-request-id"]
        r2 = client.post("/v1/chat/completions", json=chat("A")[0])
        assert r2.status_code == 200
    # It ended cancelled (client gone), never completed, and only then was the
    # next request dispatched.
    second = r2.headers["x-request-id"]
    gw.wait_for("SELECT 1 FROM requests WHERE id = ? AND status = 'completed'", second)
    (gone,) = gw.sql(
        "SELECT seq, json_extract(data, '$.reason') AS reason FROM events "
        "WHERE request_id = ? AND type IN ('request_cancelled', 'request_completed')",
        first,
    )
    assert gone["reason"] == "client_gone"
    (dispatched,) = gw.sql(
        "SELECT seq FROM events WHERE request_id = ? AND type = 'request_dispatched'", second
    )
    assert dispatched["seq"] > gone["seq"]


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(gateway: Start) -> None:
    gw = gateway(three_models() + "server:\n  maxBodyBytes: 2000\n")
    with gw.client() as client:
        r = client.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400 and "model" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json={"model": "nope"})
        assert r.status_code == 404
        assert "A, B, C" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json={"model": "A", "pad": "x" * 5000})
        assert r.status_code == 413 and "2000" in r.json()["error"]["message"]
        assert client.post("/v1/chat/completions", json=chat("A")[0]).status_code == 200
    rows = gw.wait_for(
        "SELECT http_status FROM requests WHERE status='failed' ORDER BY enqueued_at", count=4
    )
    statuses = [r["http_status"] for r in rows]
    assert statuses == [400, 400, 404, 413]


def test_upstream_that_fails_to_start_gives_502_with_its_output(gateway: Start) -> None:
    config = three_models() + "".join(fake_model("broken", "--exit-at-start").replace("\n", "\n  "))
    gw = gateway(config.replace("models:", "models:", 1))
    with gw.client() as client:
        r = client.post("/v1/chat/completions", json=chat("broken")[0])
        assert r.status_code == 502
        assert "failed to start" in r.json()["error"]["message"]
        assert client.post("/v1/chat/completions", json=chat("A")[0]).status_code == 200
    rows = gw.wait_for("SELECT http_status, error FROM requests WHERE status='failed'")
    assert rows[0]["http_status"] == 502


def test_upstream_dying_mid_stream_raises_in_the_client_is_recorded_and_the_next_works(
    gateway: Start,
) -> None:
    # A stream that just stops reads as a complete, shorter answer: the client is
    # told the upstream died (a last error event), as when the upstream goes silent.
    gw = gateway(three_models())
    client = OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="A",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_body={"fake": {"chunks": 6, "chunk_delay": 0.05, "die_mid_stream": True}},
    )
    got = []
    with pytest.raises(openai.APIError, match="ended the response early"):
        for chunk in stream:
            got.append(chunk)
    assert got, "the chunks sent before the upstream died reach the client"
    with gw.client() as http:
        assert http.post("/v1/chat/completions", json=chat("A")[0]).status_code == 200
    rows = gw.wait_for("SELECT error FROM requests WHERE status='failed'")
    assert "early" in rows[0]["error"]
    assert gw.wait_for(
        "SELECT 1 FROM events WHERE type='process_stopped' AND data LIKE '%crashed%'"
    )


def test_one_model_resident_at_a_time(gateway: Start) -> None:
    gw = gateway(three_models())
    with gw.client() as client:
        assert client.post("/v1/chat/completions", json=chat("A")[0]).status_code == 200
        running = client.get("/running").json()["running"]
        assert [m["model"] for m in running] == ["A"]
        pid_a = running[0]["pid"]
        assert client.post("/v1/chat/completions", json=chat("B")[0]).headers["x-served-by"] == "B"
        running = client.get("/running").json()["running"]
        assert [m["model"] for m in running] == ["B"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid_a, 0)
    swaps = gw.sql("SELECT data FROM events WHERE type='swap_started' ORDER BY seq")
    assert [json.loads(s["data"])["to_model"] for s in swaps] == ["A", "B"]


def test_metrics_after_a_known_sequence(gateway: Start) -> None:
    gw = gateway(three_models(swapAffinityBonus=10))
    # A B C A with A resident is served A A B C.
    assert post_in_order(gw, [("A", None), ("B", None), ("C", None), ("A", None)]) == [0, 3, 1, 2]
    with gw.client() as client:
        text = client.get("/metrics").text
    assert 'llamaswap_scheduler_dispatched_total{band="normal"} 5.0' in text
    # The second A overtook B and C: swap affinity changed exactly that pick.
    assert 'llamaswap_scheduler_reorders_total{band="normal",reason="swap_affinity"} 1.0' in text
    assert 'llamaswap_scheduler_queue_depth{band="normal"} 0.0' in text
    assert 'gpulane_swaps_total{model="B",outcome="ok"} 1.0' in text
    assert 'gpulane_upstream_up{model="C"} 1.0' in text


def test_models_list_and_health(gateway: Start) -> None:
    gw = gateway(three_models())
    with gw.client() as client:
        assert client.get("/health").text == "OK"
        ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids == ["A", "B", "C"]


def test_send_loading_state_streams_queue_progress_then_the_answer(gateway: Start) -> None:
    gw = gateway("sendLoadingState: true\n" + three_models())
    release = gw.tmp / "release"
    with cf.ThreadPoolExecutor(2) as pool, gw.client() as client:
        # Held until the waiting stream said so: a fixed run could end first on a slow host.
        blocker = pool.submit(
            client.post, "/v1/chat/completions", json=chat("A", hold_file=str(release))[0]
        )
        wait_started(gw)
        body, _ = chat("A", reply="done waiting")
        body["stream"] = True
        try:
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                raw = r.iter_raw()
                data = b""
                while b"waiting in the queue" not in data and (chunk := next(raw, b"")):
                    data += chunk
                release.touch()
                text = (data + b"".join(raw)).decode()
        finally:
            release.touch()
        blocker.result()
    lines = [json.loads(x[6:]) for x in text.split("\n\n") if x.startswith("data: {")]
    progress = [x["choices"][0]["delta"].get("reasoning_content") for x in lines[:2]]
    assert progress[0] and "waiting in the queue" in progress[0]
    content = "".join(x["choices"][0]["delta"].get("content") or "" for x in lines)
    assert content.replace(" ", "") == "donewaiting"
    assert text.rstrip().endswith("data: [DONE]")


def test_serve_refuses_a_database_that_is_not_gpulanes(tmp_path: Path) -> None:
    bad = tmp_path / "photos.db"
    bad.write_bytes(b"this is not an SQLite file at all" * 100)
    config = tmp_path / "config.yaml"
    config.write_text(three_models())
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "serve",
            "--config",
            str(config),
            "--listen",
            "127.0.0.1:1",
            "--db",
            str(bad),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert str(bad) in result.stderr
    assert bad.read_bytes().startswith(b"this is not")  # untouched
