"""gpulane's own ComfyUI websocket, `/comfyui/ws?clientId=X` (docs/renders.md).

A ComfyUI client opens the socket with its client id and posts prompts with the
same `client_id`; ComfyUI sends a prompt's messages only to that id's socket.
Behind gpulane the client's socket is gpulane's: the held runner sends each
prompt to ComfyUI under its probe's id, and the probe hands every message of
the prompt to the sockets of (the prompt's caller, its `client_id`). The real
server in front of tools/fake_comfyui.py, which routes messages as ComfyUI does.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import struct
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

from tests.e2e.gateway import Gateway, half_done, progress_events, wait_for
from tests.e2e.test_renders import Start, chat, comfy_config, history, rendering, workflow

KEYS = textwrap.dedent(
    """
    apiKeys:
      - {key: sk-admin-0000000000, label: admin, role: admin}
      - {key: sk-alice-0000000000, label: alice, role: user}
      - {key: sk-bob-00000000000, label: bob, role: user}
    """
)
ALICE = {"Authorization": "Bearer sk-alice-0000000000"}
BOB = {"Authorization": "Bearer sk-bob-00000000000"}


def socket(gw: Gateway, client_id: str, headers: dict[str, str] | None = None) -> ClientConnection:
    url = gw.url.replace("http", "ws", 1) + f"/comfyui/ws?clientId={client_id}"
    return connect(url, additional_headers=headers or {}, open_timeout=30, max_size=None)


def until_end(ws: ClientConnection, prompt_id: str, timeout: float = 60) -> list[Any]:
    """Every message the socket gets (JSON decoded; previews as bytes) until
    `prompt_id`'s last one: `executing` with no node, as ComfyUI ends a prompt."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no end of {prompt_id} within {timeout} s: {got}"
        raw = ws.recv(timeout=left)
        message = raw if isinstance(raw, bytes) else json.loads(raw)
        got.append(message)
        if isinstance(message, dict) and message["type"] == "executing":
            data = message["data"]
            if data["node"] is None and data["prompt_id"] == prompt_id:
                return got


def kinds(messages: list[Any], prompt_id: str | None = None) -> list[str]:
    """The JSON messages' types (of `prompt_id`'s, when given)."""
    return [
        m["type"]
        for m in messages
        if isinstance(m, dict) and (prompt_id is None or m["data"].get("prompt_id") == prompt_id)
    ]


def steps(messages: list[Any], prompt_id: str) -> list[int]:
    return [
        m["data"]["value"]
        for m in messages
        if isinstance(m, dict) and m["type"] == "progress" and m["data"]["prompt_id"] == prompt_id
    ]


def prompt_ids(messages: list[Any]) -> set[str]:
    return {
        m["data"]["prompt_id"]
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("data"), dict) and "prompt_id" in m["data"]
    }


def post(
    client: httpx.Client, client_id: str | None, seconds: float, steps: int = 10, **inputs: Any
) -> str:
    body: dict[str, Any] = {"prompt": workflow(seconds, steps=steps, **inputs)}
    if client_id is not None:
        body["client_id"] = client_id
    r = client.post("/comfyui/prompt", json=body)
    assert r.status_code == 200, r.text
    prompt_id: str = r.json()["prompt_id"]
    return prompt_id


def test_a_prompt_with_its_own_client_id_reports_its_progress_to_gpulane(
    gateway: Start, tmp_path: Path
) -> None:
    """ComfyUI sends a prompt's progress only to its `client_id`'s socket: gpulane
    sends the prompt under its probe's id, so it hears the progress of a prompt
    whose client named its own id, and `/api/queue` shows it."""
    gw = gateway(comfy_config(tmp_path / "renders.jsonl"))
    # Its last step is held until half of it was seen: a render of a fixed 6 s
    # could pass its half unseen between two polls on a loaded host.
    release = tmp_path / "release-render"
    with gw.client() as client:
        prompt_id = post(client, "my-own-id", 6.0, steps=30, hold_file=str(release))
        try:
            half, seen = half_done(client, prompt_id)
        finally:
            release.touch()
        assert seen[-1][1] == 30, seen
        assert history(client, prompt_id)[prompt_id]["status"]["completed"] is True
    query = "SELECT 1 FROM events WHERE request_id=? AND type='request_progressed'"
    gw.wait_for(query, prompt_id, count=2)  # once on disk (group-committed)
    assert len(progress_events(gw, prompt_id)) >= 2


def test_a_user_key_hears_its_prompt_through_gpulanes_socket(
    gateway: Start, tmp_path: Path
) -> None:
    """A user key opens `/comfyui/ws?clientId=X` (it used to be admin only: a raw
    proxy to ComfyUI's socket), posts a prompt with `client_id` X and hears all
    of it through gpulane: the socket's opening `status`, the prompt's start,
    every step, the previews, its success and its end (which ComfyUI sends
    after the history says the prompt ended: gpulane waits for it), with the
    `prompt_id` it was answered with."""
    record = tmp_path / "renders.jsonl"
    gw = gateway(comfy_config(record, keys=KEYS))
    with gw.client(headers=ALICE) as alice, socket(gw, "studio-1", ALICE) as ws:
        opened = json.loads(ws.recv(timeout=30))
        assert opened["type"] == "status", opened
        assert opened["data"]["sid"] == "studio-1"
        assert opened["data"]["status"]["exec_info"]["queue_remaining"] == 0
        # ComfyUI sends the last message after the history entry: here 0.6 s after.
        prompt_id = post(alice, "studio-1", 2.0, steps=10, last_message_after=0.6)
        messages = until_end(ws, prompt_id)
        assert steps(messages, prompt_id) == list(range(1, 11)), messages
        seen = kinds(messages, prompt_id)
        for kind in ("execution_start", "execution_cached", "executing", "execution_success"):
            assert kind in seen, (kind, seen)
        assert seen.index("execution_start") < seen.index("progress")
        assert prompt_ids(messages) == {prompt_id}
        previews = [m for m in messages if isinstance(m, bytes)]
        assert len(previews) == 10 and struct.unpack(">I", previews[0][:4]) == (1,), previews[:1]
        # ComfyUI's own queue status (its sid, its queue) never reaches the client.
        for m in messages:
            if isinstance(m, dict) and m["type"] == "status":
                assert "sid" not in m["data"], m
        assert history(alice, prompt_id)[prompt_id]["status"]["completed"] is True


def test_two_callers_with_the_same_client_id_each_hear_only_their_own_prompts(
    gateway: Start, tmp_path: Path
) -> None:
    """Sockets are gpulane's, keyed by (caller, clientId): alice and bob both use
    `same` (ComfyUI would give the id's messages to whoever connected last).
    Three prompts render one after another, alice's, bob's, alice's: each
    socket hears its caller's prompts and nothing of the other's."""
    record = tmp_path / "renders.jsonl"
    gw = gateway(comfy_config(record, keys=KEYS))
    with (
        gw.client(headers=ALICE) as alice,
        gw.client(headers=BOB) as bob,
        socket(gw, "same", ALICE) as alice_ws,
        socket(gw, "same", BOB) as bob_ws,
        cf.ThreadPoolExecutor(2) as pool,
    ):
        assert json.loads(alice_ws.recv(timeout=30))["type"] == "status"
        assert json.loads(bob_ws.recv(timeout=30))["type"] == "status"
        first = post(alice, "same", 1.0, steps=5)
        theirs = post(bob, "same", 1.0, steps=5)
        second = post(alice, "same", 0.5, steps=5)
        # Renders run one at a time, each prompt's messages in order: by the end
        # of alice's second, bob's would have reached alice's socket.
        heard_by_alice = pool.submit(until_end, alice_ws, second, 90)
        heard_by_bob = pool.submit(until_end, bob_ws, theirs, 90)
        alices, bobs = heard_by_alice.result(timeout=100), heard_by_bob.result(timeout=100)
    assert prompt_ids(alices) == {first, second}, kinds(alices)
    assert prompt_ids(bobs) == {theirs}, kinds(bobs)
    assert steps(alices, first) == steps(alices, second) == steps(bobs, theirs) == [1, 2, 3, 4, 5]
    assert "execution_success" in kinds(bobs, theirs)


def test_a_socket_hears_its_prompt_wait_in_gpulanes_queue_and_then_render_after_a_swap(
    gateway: Start, tmp_path: Path
) -> None:
    """The socket is opened before ComfyUI runs (it used to be 409 then), and its
    prompt waits behind a chat on the one GPU: the socket says so (`status`,
    queue_remaining 1) while ComfyUI is not even loaded, then, once the chat
    ends and ComfyUI is swapped in, hears the render, and its queue goes back
    to 0. ComfyUI swapped out and in again, it hears the next one too."""
    record = tmp_path / "renders.jsonl"
    gw = gateway(comfy_config(record))
    release = tmp_path / "release-chat"
    busy = chat() | {"fake": {"hold_file": str(release)}}
    with gw.client() as client, cf.ThreadPoolExecutor(1) as pool, socket(gw, "w") as ws:
        opened = json.loads(ws.recv(timeout=30))
        assert opened["data"] == {"status": {"exec_info": {"queue_remaining": 0}}, "sid": "w"}
        answered = pool.submit(client.post, "/v1/chat/completions", json=busy)

        def chat_runs() -> bool:
            running = client.get("/running").json()["running"]
            return any(m["model"] == "chat" and m["in_flight"] for m in running)

        assert wait_for(chat_runs), "the chat never ran"
        prompt_id = post(client, "w", 1.0, steps=5)
        waiting = json.loads(ws.recv(timeout=30))
        assert waiting == {
            "type": "status",
            "data": {"status": {"exec_info": {"queue_remaining": 1}}},
        }
        assert not rendering(record, prompt_id)
        models = {m["model"] for m in client.get("/running").json()["running"]}
        assert "comfyui_auto" not in models, models
        release.touch()
        assert answered.result(timeout=30).status_code == 200
        messages = until_end(ws, prompt_id)
        assert steps(messages, prompt_id) == [1, 2, 3, 4, 5]
        assert "execution_success" in kinds(messages, prompt_id)
        done = json.loads(ws.recv(timeout=30))
        assert done == {"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 0}}}}
        # A chat swaps ComfyUI out, a prompt swaps a new ComfyUI in: the same socket hears it.
        running = client.get("/running").json()["running"]
        pid = next(m["pid"] for m in running if m["model"] == "comfyui_auto")
        assert client.post("/v1/chat/completions", json=chat()).status_code == 200
        again = post(client, "w", 0.5, steps=5)
        messages = until_end(ws, again)
        assert steps(messages, again) == [1, 2, 3, 4, 5]
        running = client.get("/running").json()["running"]
        assert [m["pid"] for m in running if m["model"] == "comfyui_auto"] != [pid]


def test_a_prompt_interrupted_through_gpulane_tells_its_socket_how_it_ended(
    gateway: Start, tmp_path: Path
) -> None:
    """`POST /comfyui/interrupt` cancels the render in gpulane, which interrupts
    it in ComfyUI: the socket still hears ComfyUI say so (`execution_interrupted`,
    then the prompt's last `executing`), and its queue go back to 0."""
    gw = gateway(comfy_config(tmp_path / "renders.jsonl"))
    with gw.client() as client, socket(gw, "i") as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "status"
        # Held at its last step: it is still running when interrupted, however slow the host.
        prompt_id = post(client, "i", 20.0, steps=100, hold_file=str(tmp_path / "never"))
        deadline = time.monotonic() + 30
        while True:
            raw = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
            if isinstance(raw, str) and json.loads(raw)["type"] == "progress":
                break
        assert client.post("/comfyui/interrupt", json={}).status_code == 200
        messages = until_end(ws, prompt_id)
        assert "execution_interrupted" in kinds(messages, prompt_id), kinds(messages)
        assert "execution_success" not in kinds(messages, prompt_id)
        # The cancel is recorded before ComfyUI hears of it: the status may come first.
        if "status" not in kinds(messages):
            messages.append(json.loads(ws.recv(timeout=30)))
        (status,) = [m for m in messages if isinstance(m, dict) and m["type"] == "status"]
        assert status["data"]["status"]["exec_info"]["queue_remaining"] == 0, status
    # Read once its end is on disk (rows are written with the events, group-committed).
    ended = "SELECT status FROM requests WHERE id=? AND status NOT IN ('queued', 'running')"
    (row,) = gw.wait_for(ended, prompt_id)
    assert row["status"] == "cancelled"
