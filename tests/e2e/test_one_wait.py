"""One definition of wait (issue 32): every reader says the same wait for a request.

Measured before: for a request that caused a swap, history said 0 ms, explain
0.000 s and the replay 0.6 s (its own swap counted as wait); a request cancelled
while it waited showed `–` in history and 10.554 s in explain. The wait is from
arrival to dispatch, or to the end of one never dispatched (app/core/wait.py,
docs/queries.md): history, explain, the views, the response header, /metrics and
the replay must all say so.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Callable

import httpx
import pytest

from tests.e2e.gateway import REPO, Gateway, fake_model

CHAT = "/v1/chat/completions"
SWAP_S = 1.5
"""How long model A takes to answer its health check: the swap of the first request
(long beside a dispatch, which a loaded host may delay by tenths of a second)."""


def chat(client: httpx.Client, priority: str, **fake: object) -> httpx.Response:
    body = {"model": "A", "messages": [{"role": "user", "content": "hi"}], "fake": fake}
    return client.post(CHAT, json=body, headers={"X-LlamaSwap-Priority": priority})


def metric(text: str, name: str, band: str) -> float:
    found = re.search(rf'^{name}{{band="{band}"}} (\S+)$', text, re.M)
    assert found is not None, (name, band)
    return float(found.group(1))


def test_history_explain_views_header_metrics_and_replay_say_one_wait(
    gateway: Callable[[str], Gateway],
) -> None:
    gw = gateway("models:" + fake_model("A", "--start-delay", str(SWAP_S)).replace("\n", "\n  "))
    with gw.client() as client:
        # Interactive: dispatched on arrival, then it waits for its own swap of A.
        swapped = chat(client, "interactive")
        assert swapped.status_code == 200, swapped.text
        swapped_id = swapped.headers["x-request-id"]
        header_ms = float(swapped.headers["x-gpulane-queue-wait-ms"])
        # Batch: queued behind a normal request that holds A, until its deadline.
        # Held until the batch request's deadline has passed: a fixed run could
        # end first on a slow host, and the batch one run in time.
        release = gw.tmp / "release"
        with httpx.Client(base_url=gw.url, timeout=60) as other:
            holder = threading.Thread(
                target=chat, args=(other, "normal"), kwargs={"hold_file": str(release)}
            )
            holder.start()
            try:
                assert gw.wait_for("SELECT id FROM requests WHERE status = 'running'")
                cancelled = client.post(
                    CHAT,
                    json={"model": "A", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"X-LlamaSwap-Priority": "batch", "X-Gpulane-Max-Wait": "0.5"},
                )
            finally:
                release.touch()
            holder.join()
        assert cancelled.status_code == 503, cancelled.text
        cancelled_id = cancelled.headers["x-request-id"]
        gw.wait_for("SELECT id FROM requests WHERE finished_at IS NOT NULL", count=3)

        history = {
            r["id"]: r["queue_wait_ms"] / 1000
            for r in client.get("/ui/api/history", params={"hours": 1}).json()["rows"]
        }
        explained = {
            rid: client.get(f"/api/requests/{rid}/explain").json()
            for rid in (swapped_id, cancelled_id)
        }
        metrics = client.get("/metrics").text

    # The swap came after its dispatch: its swap, not its wait.
    swap = explained[swapped_id]["own_swap"]
    assert swap is not None and swap["duration_s"] >= SWAP_S
    wait = explained[swapped_id]["wait_s"]
    assert wait < SWAP_S / 2
    assert history[swapped_id] == pytest.approx(wait, abs=1e-6)
    assert header_ms / 1000 == pytest.approx(wait, abs=1e-4)

    # Cancelled while queued: it waited until its end (its deadline, 0.5 s).
    story = explained[cancelled_id]
    assert (story["status"], story["dispatched_at"]) == ("cancelled", None)
    assert story["wait_s"] >= 0.45  # the timer runs on the loop's clock, not the log's
    assert history[cancelled_id] == pytest.approx(story["wait_s"], abs=1e-6)

    views = {
        r["id"]: r["wait_s"]
        for r in gw.sql("SELECT id, wait_s FROM request_times WHERE id IN (?, ?)", *explained)
    }
    assert views == pytest.approx({rid: x["wait_s"] for rid, x in explained.items()}, abs=1e-6)

    # /metrics: one observation per request, its wait (the cancelled one at its end).
    assert metric(metrics, "gpulane_queue_wait_seconds_count", "interactive") == 1
    assert metric(metrics, "gpulane_queue_wait_seconds_sum", "interactive") == pytest.approx(
        wait, abs=1e-6
    )
    assert metric(metrics, "gpulane_queue_wait_seconds_count", "batch") == 1
    assert metric(metrics, "gpulane_queue_wait_seconds_sum", "batch") == pytest.approx(
        story["wait_s"], abs=1e-6
    )

    # The replay's figures of the recorded run: the same wait; the batch client left.
    out = subprocess.run(
        [sys.executable, "-m", "tools.replay", str(gw.db), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    recorded = next(r for r in json.loads(out)["runs"] if r["kind"] == "recorded")
    assert recorded["bands"]["interactive"]["wait_max_s"] == pytest.approx(wait, abs=0.0015)
    assert recorded["bands"]["batch"]["left"] == 1
