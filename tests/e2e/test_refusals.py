"""Why was my request refused? Every door records a refusal the same way.

A request refused before it is queued is a `request_rejected` event in the
log, with its endpoint, status and error, and its answer carries that
record's id as `X-Request-Id`, so `gpulane explain ID` tells the story after
the fact. Synchronous chats have done so since the beginning; these are the
durable jobs' doors (`Prefer: respond-async`, the Batch API, `/v1/videos`,
`/comfyui/prompt`) and the model's own server (`/upstream/MODEL/...`), each
refused for a representative reason, through the real server.

Measured before: none of these refusals was in the log (nor had an id).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.gateway import REPO, Gateway, fake_model, poll

Start = Callable[[str], Gateway]
ASYNC = {"Prefer": "respond-async"}
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def config(tmp: Path) -> str:
    """A chat model, a Videos API server and ComfyUI: none is loaded by a refusal."""
    servers = textwrap.dedent(
        f"""
          sora-local:
            kind: openai-videos
            cmd: {sys.executable} -m tools.fake_video_server --port ${{PORT}} --record {tmp}/v
            checkEndpoint: /health
          comfyui_auto:
            cmd: {sys.executable} -m tools.fake_comfyui --port ${{PORT}} --record {tmp}/c
            checkEndpoint: /system_stats
        """
    )
    return "models:" + (servers + fake_model("m")).replace("\n", "\n  ") + "\n"


def chat() -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refusal(gw: Gateway, r: httpx.Response, status: int) -> tuple[str, dict[str, Any]]:
    """The refused answer's id and its `request_rejected` event."""
    assert r.status_code == status, r.text
    request_id = r.headers.get("x-request-id")
    assert request_id, f"no X-Request-Id on the refusal: {dict(r.headers)}"
    rows = gw.wait_for(
        "SELECT data FROM events WHERE type = 'request_rejected' AND request_id = ?", request_id
    )
    assert len(rows) == 1, f"no request_rejected {request_id} in the log"
    event: dict[str, Any] = json.loads(rows[0]["data"])
    assert event["http_status"] == status
    return request_id, event


def explained(gw: Gateway, request_id: str) -> str:
    """`gpulane explain ID`, as a user runs it beside the server."""
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "explain", request_id, "--db", str(gw.db)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_each_door_records_its_refusals_and_explain_tells_them(
    gateway: Start, tmp_path: Path
) -> None:
    gw = gateway(config(tmp_path))
    with gw.client() as client:
        # Prefer: respond-async, a header the job would store over its limit.
        r = client.post("/v1/chat/completions", json=chat(), headers=ASYNC | {"X-Big": "v" * 8193})
        rid, event = refusal(gw, r, 431)
        assert event["endpoint"] == "/v1/chat/completions" and event["model_requested"] == "m"
        assert "header x-big has 8198 bytes" in event["error"]
        story = explained(gw, rid)
        assert f"request {rid}: rejected" in story
        # Its model was configured: refused for its header, not for the model.
        assert "model 'm' · /v1/chat/completions" in story and "not resolved" not in story
        assert "rejected at admission: HTTP 431: header x-big has 8198 bytes" in story

        # ... and an Idempotency-Key over its limit.
        r = client.post(
            "/v1/chat/completions", json=chat(), headers=ASYNC | {"Idempotency-Key": "k" * 256}
        )
        rid, event = refusal(gw, r, 400)
        assert "Idempotency-Key has 256 bytes" in event["error"]

        # The Batch API: a completion window it does not take, and a file it does not have.
        order = {"input_file_id": "file-nope", "endpoint": "/v1/chat/completions"}
        r = client.post("/v1/batches", json=order | {"completion_window": "forever"})
        rid, event = refusal(gw, r, 400)
        assert event["endpoint"] == "/v1/batches" and "completion_window" in event["error"]
        assert event["band"] == "batch"  # a batch's lines queue in the batch band
        assert "rejected at admission: HTTP 400: completion_window 'forever'" in explained(gw, rid)
        r = client.post("/v1/batches", json=order | {"completion_window": "24h"})
        rid, event = refusal(gw, r, 404)
        assert event["error"] == "no file file-nope"

        # /v1/videos: a model that is not configured.
        r = client.post("/v1/videos", json={"model": "nope", "prompt": "a cat"})
        rid, event = refusal(gw, r, 404)
        assert event["endpoint"] == "/v1/videos" and event["model_requested"] == "nope"
        story = explained(gw, rid)
        assert "model 'nope' is not configured; video models: sora-local" in story
        # ... and no prompt.
        r = client.post("/v1/videos", json={"model": "sora-local"})
        rid, event = refusal(gw, r, 400)
        assert event["model_requested"] == "sora-local" and "prompt is required" in event["error"]

        # /comfyui/prompt: no prompt (answered in ComfyUI's shape), a bad max wait.
        r = client.post("/comfyui/prompt", json={"client_id": "x"})
        rid, event = refusal(gw, r, 400)
        assert r.json()["error"]["type"] == "no_prompt"
        assert event["endpoint"] == "/comfyui/prompt"
        assert event["model_requested"] == "comfyui_auto"
        assert "rejected at admission: HTTP 400: No prompt provided" in explained(gw, rid)
        r = client.post(
            "/comfyui/prompt", json={"prompt": {}}, headers={"X-Gpulane-Max-Wait": "soon"}
        )
        rid, event = refusal(gw, r, 400)
        assert "X-Gpulane-Max-Wait" in event["error"]

        # /upstream/MODEL/...: a model that is not configured.
        r = client.post("/upstream/nope/v1/chat/completions", json=chat())
        rid, event = refusal(gw, r, 404)
        assert event["endpoint"] == "/upstream/v1/chat/completions"
        assert event["model_requested"] == "nope"

        # A synchronous chat's refusals carry their id too.
        r = client.post("/v1/chat/completions", json=chat() | {"model": "nope"})
        rid, event = refusal(gw, r, 404)
        assert "rejected at admission: HTTP 404: model 'nope'" in explained(gw, rid)

        # The console's history lists them as rejected (its filter), not as failed.
        refused = client.get("/ui/api/history?status=rejected").json()
        assert refused["total"] == 10, refused
        assert {row["status"] for row in refused["rows"]} == {"rejected"}
        assert {row["http_status"] for row in refused["rows"]} == {400, 404, 431}
        assert client.get("/ui/api/history?status=failed").json()["total"] == 0

        # No refusal loaded a model or queued anything.
        assert client.get("/running").json()["running"] == []
    assert gw.sql("SELECT count(*) FROM requests WHERE model IS NOT NULL")[0][0] == 0
    assert gw.db_check().returncode == 0


def test_a_durable_job_refused_by_the_queue_or_its_key_is_recorded_once(
    gateway: Start, tmp_path: Path
) -> None:
    """A full queue (the scheduler's refusal, recorded by the jobs service) and an
    Idempotency-Key reused with another body (the service's error, recorded by
    the door): each answered with its record's id, each recorded once."""
    gw = gateway("maxQueued: 1\n" + config(tmp_path))
    release = tmp_path / "release"
    held = chat() | {"fake": {"hold_file": str(release)}}
    try:
        with gw.client() as client:
            # One running, one waiting: the second is sent once the first runs (sent
            # while the first waited for its model's load, it would find the queue full).
            queue = lambda: client.get("/api/queue").json()  # noqa: E731
            r = client.post("/v1/chat/completions", json=held, headers=ASYNC)
            assert r.status_code == 202, r.text
            poll(lambda: queue()["running"], "the first job to run")
            r = client.post("/v1/chat/completions", json=held, headers=ASYNC)
            assert r.status_code == 202, r.text
            poll(lambda: len(queue()["waiting"]) == 1, "the second job to wait")
            r = client.post("/v1/chat/completions", json=chat(), headers=ASYNC)
            rid, event = refusal(gw, r, 429)
            assert event["reason"] == "queue_full"
            assert "rejected at admission: HTTP 429" in explained(gw, rid)

            keyed = ASYNC | {"Idempotency-Key": "order-17"}
            release.touch()
            poll(lambda: not client.get("/api/queue").json()["waiting"], "the queue to drain")
            assert client.post("/v1/audio/speech", json=chat(), headers=keyed).status_code == 202
            r = client.post("/v1/audio/speech", json=chat() | {"seed": 2}, headers=keyed)
            rid, event = refusal(gw, r, 409)
            assert r.json()["error"]["code"] == "idempotency_key_reused"
            assert "Idempotency-Key 'order-17' was already used" in event["error"]
        rows = gw.sql("SELECT count(*) FROM events WHERE type = 'request_rejected'")
        assert rows[0][0] == 2
    finally:
        release.touch()


def test_a_refusal_quoting_a_huge_model_name_stores_a_bounded_record(
    gateway: Start, tmp_path: Path
) -> None:
    """A refused request writes what was wrong, not the caller's whole body: a
    1 MiB model name (a body the server accepts) used to put 2 MiB into the
    event and as much again into the `requests` row, each time it was sent."""
    gw = gateway(config(tmp_path))
    huge = "x" * (1 << 20)
    with httpx.Client(base_url=gw.url, timeout=60) as client:
        r = client.post("/v1/chat/completions", json={**chat(), "model": huge})
        request_id, event = refusal(gw, r, 404)
    assert len(json.dumps(event)) < 8192, len(json.dumps(event))
    assert event["model_requested"].startswith("xxx") and "cut" in event["model_requested"]
    row = gw.sql("SELECT * FROM requests WHERE id = ?", request_id)
    assert row and sum(len(str(v)) for v in tuple(row[0])) < 8192
    assert "model" in explained(gw, request_id)
