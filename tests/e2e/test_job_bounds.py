"""What one caller may store with its durable jobs is bounded (issue 38).

Measured before: a 60 KiB `Idempotency-Key` was stored as sent in the event,
the request row and its index (100 such jobs: 21.5 MB), and so was any 60 KiB
header of a durable job; the bytes one caller's queued bodies took had no
bound but the queue's count. Now the key and each stored header have a length
limit, a caller's stored bytes a cap (`jobs.maxStoredBytesPerCaller`), each
refused with a 4xx naming the limit, before anything is written.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.gateway import Gateway, fake_model, poll

Start = Callable[[str], Gateway]
ASYNC = {"Prefer": "respond-async"}
MAX_IDEMPOTENCY_KEY_BYTES = 255
"""The limits as docs/http.md gives them (app/jobs/stored_bytes.py)."""
MAX_STORED_HEADER_BYTES = 8192


def config(extra: str = "") -> str:
    return f"{extra}models:" + fake_model("m").replace("\n", "\n  ") + "\n"


def chat(**fake: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "fake": fake}


def stored(gw: Gateway) -> tuple[int, int]:
    """(requests queued, job bodies) in the database; a refusal's record has no model."""
    rows = gw.sql(
        "SELECT (SELECT count(*) FROM requests WHERE model IS NOT NULL), "
        "(SELECT count(*) FROM job_bodies)"
    )
    return int(rows[0][0]), int(rows[0][1])


def test_an_idempotency_key_and_a_stored_header_have_length_limits(gateway: Start) -> None:
    gw = gateway(config())
    with gw.client() as client:
        too_long = "k" * (MAX_IDEMPOTENCY_KEY_BYTES + 1)
        r = client.post(
            "/v1/chat/completions", json=chat(), headers=ASYNC | {"Idempotency-Key": too_long}
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "idempotency_key_too_long"
        assert error["param"] == "Idempotency-Key"
        assert f"at most {MAX_IDEMPOTENCY_KEY_BYTES} bytes" in error["message"]
        # 60 KiB, as measured: refused the same, and nothing of it stored.
        r = client.post(
            "/v1/chat/completions", json=chat(), headers=ASYNC | {"Idempotency-Key": "k" * 61440}
        )
        assert r.status_code == 400 and "61440 bytes" in r.json()["error"]["message"]

        big = "v" * MAX_STORED_HEADER_BYTES
        r = client.post("/v1/chat/completions", json=chat(), headers=ASYNC | {"X-Big": big})
        assert r.status_code == 431, r.text
        error = r.json()["error"]
        assert error["code"] == "stored_header_too_large" and error["param"] == "x-big"
        assert f"at most {MAX_STORED_HEADER_BYTES} bytes" in error["message"]
        assert stored(gw) == (0, 0)
        # Each refusal is recorded, without the bytes refused (the message gives their size).
        refusals = gw.wait_for(
            "SELECT length(data) FROM events WHERE type = 'request_rejected'", count=3
        )
        assert len(refusals) == 3 and max(r[0] for r in refusals) < 1000

        # The same header on a synchronous request is only forwarded: not refused.
        assert (
            client.post("/v1/chat/completions", json=chat(), headers={"X-Big": big}).status_code
            == 200
        )

        # At the limits, accepted; the stored header is what is forwarded upstream, whole.
        at_limit = "v" * (MAX_STORED_HEADER_BYTES - len("x-big"))
        key = "k" * MAX_IDEMPOTENCY_KEY_BYTES
        r = client.post(
            "/v1/audio/speech",
            json={"model": "m", "input": "hi"},
            headers=ASYNC | {"Idempotency-Key": key, "X-Big": at_limit},
        )
        assert r.status_code == 202, r.text
        job = r.json()["id"]
        poll(lambda: client.get(f"/v1/jobs/{job}").json()["status"] == "completed", "done")
        echoed = client.get(f"/v1/jobs/{job}/result").json()["headers"]
        assert {k.lower(): v for k, v in echoed.items()}["x-big"] == at_limit
        (row,) = gw.sql("SELECT job, idempotency_key FROM requests WHERE id = ?", job)
        assert json.loads(row[0])["headers"]["x-big"] == at_limit and row[1] == key


def test_a_callers_stored_bytes_have_a_cap(gateway: Start, tmp_path: Path) -> None:
    cap = 40_000
    gw = gateway(config(f"jobs:\n  maxStoredBytesPerCaller: {cap}\n"))
    release = tmp_path / "release"
    padding = "x" * 15_000

    def submit(client: httpx.Client, caller: str, **fake: Any) -> httpx.Response:
        body = chat(**fake) | {"padding": padding}
        return client.post(
            "/v1/chat/completions", json=body, headers=ASYNC | {"X-Gpulane-Caller": caller}
        )

    with gw.client() as client:
        held = submit(client, "alice", hold_file=str(release))
        second = submit(client, "alice")
        assert held.status_code == second.status_code == 202
        over = submit(client, "alice")
        assert over.status_code == 429, over.text
        error = over.json()["error"]
        assert error["code"] == "caller_storage_full"
        assert "jobs.maxStoredBytesPerCaller" in error["message"] and str(cap) in error["message"]
        assert "caller 'alice'" in error["message"]
        # A batch whose lines would pass it is refused the same, before any line is queued.
        batch_line = {
            "custom_id": "one",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": chat() | {"padding": padding},
        }
        alice = {"X-Gpulane-Caller": "alice"}
        uploaded = client.post(
            "/v1/files",
            files={"file": ("in.jsonl", json.dumps(batch_line).encode() + b"\n")},
            data={"purpose": "batch"},
            headers=alice,
        )
        assert uploaded.status_code == 200, uploaded.text
        batch = client.post(
            "/v1/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
            headers=alice,
        )
        assert batch.status_code == 429, batch.text
        assert batch.json()["error"]["code"] == "caller_storage_full"
        # Another caller's jobs are its own.
        assert submit(client, "bob").status_code == 202
        # Both refusals are in the log, the batch's under its own endpoint.
        rejected = gw.wait_for(
            "SELECT data FROM events WHERE type = 'request_rejected' ORDER BY seq", count=2
        )
        assert [(json.loads(r[0])["reason"], json.loads(r[0])["endpoint"]) for r in rejected] == [
            ("caller_storage_full", "/v1/chat/completions"),
            ("caller_storage_full", "/v1/batches"),
        ]
        assert batch.headers["x-request-id"] == json.loads(rejected[1][0])["request_id"]

        # Ended jobs hold nothing: alice may store again.
        release.touch()
        for job in (held.json()["id"], second.json()["id"]):
            poll(lambda j=job: client.get(f"/v1/jobs/{j}").json()["status"] == "completed", "done")
        assert submit(client, "alice").status_code == 202


def test_the_jobs_a_restart_recovers_count_against_their_caller(
    gateway: Start, tmp_path: Path
) -> None:
    gw = gateway(config("jobs:\n  maxStoredBytesPerCaller: 40000\n"))
    release = tmp_path / "release"
    body = chat(hold_file=str(release)) | {"padding": "x" * 15_000}
    alice = ASYNC | {"X-Gpulane-Caller": "alice"}
    try:
        with gw.client() as client:
            for _ in range(2):
                assert (
                    client.post("/v1/chat/completions", json=body, headers=alice).status_code == 202
                )
        gw.kill()
        gw.start()
        with gw.client() as client:
            over = client.post("/v1/chat/completions", json=body, headers=alice)
            assert over.status_code == 429, over.text
            assert over.json()["error"]["code"] == "caller_storage_full"
    finally:
        release.touch()
