"""An unload while a durable job runs, on every unload route (issue 38).

Issue 38 measured, 16 times of 16: a durable job running ~2 s upstream, its
model unloaded 0.7 s in, and every later chat waited forever (the job was put
back in the queue, dispatched again, and nobody sent it). Here each route
unloads a running job in the real server in front of tools/fake_upstream.py:
a synchronous chat for the same model and for another one is then answered,
and the job completes on its second sending.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.e2e.gateway import Gateway
from tests.e2e.test_serve_admin import chat, config, events, model

Start = Callable[[str], Gateway]

ROUTES = {
    "POST /api/models/unload": ("POST", "/api/models/unload"),
    "POST /api/models/unload/A": ("POST", "/api/models/unload/A"),
    "GET /unload": ("GET", "/unload"),
}


def job_status(client: httpx.Client, job_id: str, want: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        view: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
        if view.get("status") == want or time.monotonic() > deadline:
            return view
        time.sleep(0.05)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_an_unload_under_a_running_durable_job_leaves_every_model_serving(
    gateway: Start, route: str
) -> None:
    gw = gateway(config(model("A", maxRunTime=60), model("B", maxRunTime=60)))
    method, path = ROUTES[route]
    # The job runs until the unload has put it back (a fixed run could end first
    # on a slow host), and to its end when sent again.
    release = gw.tmp / "release"
    with gw.client(timeout=30) as client:
        accepted = client.post(
            "/v1/chat/completions",
            json=chat("A", hold_file=str(release)),
            headers={"Prefer": "respond-async"},
        )
        assert accepted.status_code == 202, accepted.text
        job_id = accepted.json()["id"]
        try:
            assert events(gw, "request_started")  # it runs upstream now
            r = client.request(method, path)
            assert r.status_code == 200, r.text
            (requeued,) = events(gw, "request_requeued")
        finally:
            release.touch()
        assert requeued["_request_id"] == job_id
        # Before the fix each of these waited forever behind the job put back.
        for name in ("A", "B"):
            answer = client.post("/v1/chat/completions", json=chat(name))
            assert answer.status_code == 200, (name, answer.text)
        view = job_status(client, job_id, "completed", timeout=30)
        assert view["status"] == "completed", view
        # Sent twice: once before the unload, once after it.
        started = events(gw, "request_started", count=4)
        assert [e["_request_id"] for e in started].count(job_id) == 2
    check = gw.db_check()
    assert check.returncode == 0, check.stdout + check.stderr
