"""The priority header says what it did (issue 32): a value that is no priority
still runs at 0, as the seeds' rule says, but the answer says so and names
what is allowed, and the log keeps why; `interactive+2` reads as the config
reads it. Through `gpulane serve`, as a user sends it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.gateway import REPO, Gateway, fake_model

CONFIG = "models:" + fake_model("A").replace("\n", "\n  ") + "\n"
CHAT = {"model": "A", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("value", ["urgent", "1.5", "99999999999999999999", "-1e3"])
def test_a_value_that_is_no_priority_runs_at_0_and_the_answer_says_why(
    gateway: object, value: str
) -> None:
    gw = gateway(CONFIG)  # type: ignore[operator]
    assert isinstance(gw, Gateway)
    with gw.client() as client:
        r = client.post("/v1/chat/completions", json=CHAT, headers={"X-LlamaSwap-Priority": value})
        assert r.status_code == 200, r.text
        assert r.headers["x-gpulane-priority-granted"] == "0"
        assert "x-gpulane-priority-requested" not in r.headers
        warning = r.headers["x-gpulane-priority-warning"]
        assert value in warning and "is not a priority" in warning
        assert "interactive" in warning and "64-bit integer" in warning  # what is allowed
    (row,) = gw.wait_for("SELECT data FROM events WHERE type = 'request_enqueued'")
    assert value in json.loads(row["data"])["priority_ignored"]
    with gw.client() as client:  # counted, and only the unreadable one
        client.post("/v1/chat/completions", json=CHAT, headers={"X-LlamaSwap-Priority": "batch"})
        assert "\ngpulane_priority_ignored_total 1.0\n" in client.get("/metrics").text
    gw.wait_for("SELECT 1 FROM events WHERE type = 'request_completed'")
    explained = subprocess.run(
        [sys.executable, "-m", "app.cli", "explain", r.headers["x-request-id"], "--db", str(gw.db)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert explained.returncode == 0, explained.stderr
    assert "none requested" not in explained.stdout
    assert f"{value!r} is not a priority" in explained.stdout


def test_a_band_with_an_offset_reads_as_in_the_config(gateway: object) -> None:
    gw = gateway(CONFIG)  # type: ignore[operator]
    with gw.client() as client:
        r = client.post(
            "/v1/chat/completions", json=CHAT, headers={"X-LlamaSwap-Priority": "interactive+2"}
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-gpulane-priority-granted"] == "102"
        assert r.headers["x-gpulane-priority-requested"] == "102"
        assert "x-gpulane-priority-warning" not in r.headers
        plain = client.post("/v1/chat/completions", json=CHAT)
        assert "x-gpulane-priority-warning" not in plain.headers
