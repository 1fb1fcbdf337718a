"""A browser's view of gpulane as llama-swap's (issue 28, item 3 and the smaller
differences), against a real `gpulane serve` with `apiKeys`: CORS preflights,
`/api/events`, `X-Accel-Buffering` on streams, the unload bodies, the
`/upstream` redirects and `/running`'s `ttl`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.gateway import Gateway, fake_model, running_gateway

KEY = "sk-admin-web"
AUTH = {"Authorization": f"Bearer {KEY}"}

CONFIG = (
    f"apiKeys: [{KEY}]\nmodels:"
    + fake_model("A", ttl=300).replace("\n", "\n  ")
    + "  name: Model A\n    aliases: [alpha]\n"
    + fake_model("B").replace("\n", "\n  ")
    + "\n"
)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(Path(tmp_path_factory.mktemp("llama_swap_web")), CONFIG) as gateway:
        yield gateway


@pytest.fixture
def client(gw: Gateway) -> Iterator[httpx.Client]:
    with gw.client(headers=AUTH) as c:
        yield c


def _chat(client: httpx.Client, model: str, **body: Any) -> httpx.Response:
    messages = [{"role": "user", "content": "hi"}]
    return client.post("/v1/chat/completions", json={"model": model, "messages": messages, **body})


# -- CORS --------------------------------------------------------------------------


def test_a_preflight_is_204_with_llama_swaps_headers_and_needs_no_key(gw: Gateway) -> None:
    with gw.client() as anonymous:  # a browser sends no credentials on a preflight
        for path in ("/v1/chat/completions", "/v1/models", "/upstream/A/x", "/no/such/route"):
            r = anonymous.options(
                path,
                headers={
                    "Origin": "http://app.example",
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization, content-type, x bad",
                },
            )
            assert r.status_code == 204, (path, r.status_code, r.text)
            assert r.headers["access-control-allow-origin"] == "*"
            assert r.headers["access-control-allow-methods"] == (
                "GET, POST, PUT, PATCH, DELETE, OPTIONS"
            )
            # Echoed, less the name that is not an HTTP token.
            assert r.headers["access-control-allow-headers"] == "authorization, content-type"
            assert r.headers["access-control-max-age"] == "86400"
            assert r.content == b""
        r = anonymous.options("/v1/chat/completions", headers={"Origin": "http://app.example"})
        assert r.status_code == 204
        assert r.headers["access-control-allow-headers"] == (
            "Content-Type, Authorization, Accept, X-Requested-With"
        )


def test_the_model_list_echoes_the_origin(client: httpx.Client) -> None:
    r = client.get("/v1/models", headers={"Origin": "http://app.example"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    assert "access-control-allow-origin" not in client.get("/v1/models").headers


# -- /api/events ---------------------------------------------------------------------


def _events(response: httpx.Response) -> Iterator[tuple[str, Any]]:
    """(type, decoded data) of each llama-swap envelope on the stream."""
    for block in _blocks(response):
        lines = block.split("\n")
        assert lines[0] == "event:message", block
        assert lines[1].startswith("data:"), block
        envelope = json.loads(lines[1][len("data:") :])
        yield envelope["type"], json.loads(envelope["data"])


def _blocks(response: httpx.Response) -> Iterator[str]:
    buffer = ""
    for text in response.iter_text():
        buffer += text
        while "\n\n" in buffer:
            block, buffer = buffer.split("\n\n", 1)
            yield block


def test_api_events_sends_llama_swaps_messages_and_follows_model_states(
    gw: Gateway, client: httpx.Client
) -> None:
    with gw.client() as anonymous:
        assert anonymous.get("/api/events").status_code == 401
    with client.stream("GET", "/api/events") as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no"
        assert r.headers["cache-control"] == "no-cache"
        events = _events(r)
        first = [next(events) for _ in range(6)]
        kinds = [kind for kind, _ in first]
        assert kinds == [
            "logData",
            "logData",
            "modelStatus",
            "uiConfig",
            "profileChanged",
            "inflight",
        ]
        assert {data["source"] for kind, data in first[:2]} == {"proxy", "upstream"}
        models = first[2][1]
        assert [m["id"] for m in models] == ["A", "B"]
        a = models[0]
        assert a == {
            "id": "A",
            "name": "Model A",
            "description": "",
            "state": a["state"],
            "unlisted": False,
            "peerID": "",
            "aliases": ["alpha"],
        }
        assert first[4][1] == {"active": None}
        assert first[5][1]["operation"] == "snapshot"
        # A request for B: B's state goes to starting/ready, and its server's
        # lines arrive as upstream log data.
        assert _chat(client, "B").status_code == 200
        states: list[str] = []
        upstream_text = ""
        deadline = time.monotonic() + 20
        for kind, data in events:
            if kind == "modelStatus":
                states.append(next(m["state"] for m in data if m["id"] == "B"))
            elif kind == "logData" and data["source"] == "upstream":
                upstream_text += data["data"]
            if states and states[-1] == "ready" and "B handled" in upstream_text:
                break
            assert time.monotonic() < deadline, (states, upstream_text)
        assert "ready" in states
        assert upstream_text.endswith("\n")


def _next_inflight(
    events: Iterator[tuple[str, Any]], wanted: Callable[[list[dict[str, Any]]], bool]
) -> list[dict[str, Any]]:
    """The requests of the next `inflight` snapshot that `wanted` accepts."""
    deadline = time.monotonic() + 20
    seen = []
    for kind, data in events:
        if kind == "inflight":
            seen.append(data)
            if wanted(data["requests"]):
                return list(data["requests"])
        assert time.monotonic() < deadline, f"no such inflight snapshot: {seen}"
    raise AssertionError(f"the stream ended; inflight snapshots seen: {seen}")


def test_api_events_sends_inflight_again_at_each_change(gw: Gateway, tmp_path: Path) -> None:
    """`inflight` first, then again whenever the running requests change: here
    a request starts (one row, its id) and ends (none)."""
    release = tmp_path / "release"
    held = {"fake": {"hold_file": str(release)}}
    # A read timeout ends the wait for an event that never comes.
    with (
        gw.client(headers=AUTH, timeout=30) as client,
        gw.client(headers=AUTH) as asker,
        ThreadPoolExecutor(1) as pool,
        client.stream("GET", "/api/events") as r,
    ):
        events = _events(r)
        assert _next_inflight(events, lambda rows: True) == []  # nothing runs yet
        answer = pool.submit(_chat, asker, "A", **held)
        try:
            [row] = _next_inflight(events, lambda rows: len(rows) == 1)
        finally:
            release.touch()  # the request ends, whatever the stream said
        assert (row["model"], row["req_path"]) == ("A", "/v1/chat/completions")
        done = answer.result(timeout=30)
        assert done.status_code == 200 and done.headers["x-request-id"] == row["id"]
        assert _next_inflight(events, lambda rows: rows == []) == []


# -- streams, unload, /upstream, /running ------------------------------------------------


def test_a_proxied_event_stream_is_not_buffered_by_nginx(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "A", "messages": messages, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no"
        r.read()
    assert "x-accel-buffering" not in _chat(client, "A").headers


def test_unload_answers_llama_swaps_bodies(gw: Gateway, client: httpx.Client) -> None:
    assert _chat(client, "A").status_code == 200
    r = client.post("/api/models/unload/alpha")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert r.text == "OK"
    r = client.post("/api/models/unload/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.post("/api/models/unload")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"msg": "ok"}
    r = client.get("/unload")
    assert r.status_code == 200 and r.text == "OK"


def test_upstream_model_without_a_slash_is_redirected(client: httpx.Client) -> None:
    r = client.get("/upstream/A?x=1")
    assert r.status_code == 301 and r.headers["location"] == "/upstream/A/?x=1"
    r = client.post("/upstream/alpha", json={})
    assert r.status_code == 308 and r.headers["location"] == "/upstream/alpha/"
    r = client.get("/upstream")
    assert r.status_code == 302 and r.headers["location"] == "/ui/models"
    assert client.post("/upstream").status_code == 405
    # With the slash it reaches the server (its echo of the path it received).
    r = client.get("/upstream/A/")
    assert r.status_code == 200 and r.json()["path"] == "/"


def test_running_gives_ttl_in_whole_seconds(client: httpx.Client) -> None:
    assert _chat(client, "A").status_code == 200
    rows = client.get("/running").json()["running"]
    [row] = [row for row in rows if row["model"] == "A"]
    assert row["ttl"] == 300 and isinstance(row["ttl"], int)
