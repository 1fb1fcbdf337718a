"""`gpulane serve --db postgresql+psycopg://...` as a user runs it, in front of a
real (fake) upstream: chats with the official client, a durable job, a batch,
the console's pages and `explain`, a second server refused, a restart that keeps
the log; then `db check`, `replay --verify` and `db backup`'s advice.

What was measured before: the URL was read as a file path.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.e2e.gateway import Gateway, fake_model, free_port, poll
from tests.e2e.log_replay import gpulane as cli

pytestmark = pytest.mark.postgres


def test_a_server_on_postgresql_serves_keeps_its_log_and_refuses_a_second(
    tmp_path: Path, postgres_url: str
) -> None:
    gw = Gateway(tmp_path, "models:" + fake_model("m").replace("\n", "\n  ") + "\n")
    gw.db = postgres_url  # type: ignore[assignment]
    try:
        gw.start()
        oa = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=30)
        raw = oa.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
        assert raw.parse().choices[0].message.content
        rid = raw.headers["x-request-id"]
        with gw.client() as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "later"}]}
            accepted = client.post(
                "/v1/chat/completions", json=body, headers={"Prefer": "respond-async"}
            )
            assert accepted.status_code == 202
            job = accepted.json()["id"]
            poll(
                lambda: client.get(f"/v1/jobs/{job}").json().get("status") == "completed",
                "the job completed",
            )
            assert client.get(f"/v1/jobs/{job}/result").json()["choices"]
            assert client.get("/api/activity").status_code == 200
            history = client.get("/ui/api/history")
            assert history.status_code == 200 and rid in history.text

        # A batch: its file, its lines as durable jobs, its output file.
        lines = [
            {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "messages": [{"role": "user", "content": cid}]}}
            for cid, model in (("one", "m"), ("two", "m"), ("lost", "no-such-model"))
        ]  # fmt: skip
        uploaded = oa.files.create(
            file=("in.jsonl", b"".join(json.dumps(x).encode() + b"\n" for x in lines)),
            purpose="batch",
        )
        batch = oa.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = poll(
            lambda: (b := oa.batches.retrieve(batch.id)).status == "completed" and b,
            "the batch to complete",
        )
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
        assert done.output_file_id is not None
        out = [json.loads(x) for x in oa.files.content(done.output_file_id).text.splitlines()]
        assert sorted(a["custom_id"] for a in out) == ["one", "two"]

        second = cli(
            "serve", "--config", str(gw.config), "--listen", f"127.0.0.1:{free_port()}",
            "--db", postgres_url,
        )  # fmt: skip
        assert second.returncode == 1, second.stdout + second.stderr
        assert f"127.0.0.1:{gw.port}" in second.stderr
        assert "another gpulane serves this database" in second.stderr

        explained = cli("explain", rid, "--db", postgres_url)
        assert explained.returncode == 0, explained.stderr
        assert rid in explained.stdout and "completed" in explained.stdout

        gw.stop()
        gw.start()  # the lease was released: a restart takes it, the log goes on
        with gw.client() as client:
            assert client.get(f"/v1/jobs/{job}").json()["status"] == "completed"
    finally:
        gw.stop()

    check = gw.db_check()
    assert check.returncode == 0, check.stdout + check.stderr
    verify = cli("replay", "--verify", postgres_url)
    assert verify.returncode == 0 and verify.stdout.startswith("ok: "), verify.stdout
    backup = cli("db", "backup", str(tmp_path / "copy.db"), "--db", postgres_url)
    assert backup.returncode == 1 and "pg_dump" in backup.stderr
