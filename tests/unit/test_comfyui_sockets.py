"""The `/comfyui/ws` hub's routing and bounds (app/web/comfyui_sockets.py),
driven through its ASGI side with a recording client; the real sockets are
tests/e2e/test_comfyui_sockets.py's."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from app.web import comfyui_sockets
from app.web.comfyui_sockets import BEHIND_MESSAGES, PREVIEW_BEHIND, ComfySockets, _Client
from tests.waiting import wait_until


def hub(*requests: tuple[str, str | None]) -> ComfySockets:
    """A hub over a scheduler whose ComfyUI model runs `requests` (id, caller)."""
    state = SimpleNamespace(
        requests={rid: SimpleNamespace(model="comfy", caller=who) for rid, who in requests}
    )
    scheduler: Any = SimpleNamespace(state=state, version=0)
    return ComfySockets(scheduler, lambda: "comfy")


class Socket:
    """One client, as uvicorn hands it to the hub: what it was sent; `stuck`
    never reads (its writes never return) once it was accepted."""

    def __init__(self, hub: ComfySockets, client_id: str, caller: str | None, stuck: bool = False):
        self.sent: list[dict[str, Any]] = []
        self.stuck = stuck
        self.gone = asyncio.Event()
        headers = [] if caller is None else [(b"x-gpulane-caller", caller.encode())]
        scope = {
            "type": "websocket",
            "headers": headers,
            "query_string": f"clientId={client_id}".encode(),
        }
        self.connected = False
        self.task = asyncio.ensure_future(hub.serve(scope, self.receive, self.send))

    async def receive(self) -> dict[str, Any]:
        if not self.connected:
            self.connected = True
            return {"type": "websocket.connect"}
        await self.gone.wait()
        return {"type": "websocket.disconnect", "code": 1000}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if self.stuck and message["type"] == "websocket.send":
            await asyncio.Event().wait()  # a client that reads nothing more

    def texts(self) -> list[dict[str, Any]]:
        return [json.loads(m["text"]) for m in self.sent if m.get("text")]

    async def close(self) -> None:
        self.gone.set()
        await asyncio.wait_for(self.task, 30)  # a hang guard


async def until(check: Any) -> None:
    await wait_until(check, "the sockets' messages", timeout=30)  # a hang guard


async def test_a_prompts_messages_reach_only_its_callers_socket_with_its_client_id() -> None:
    h = hub(("p-alice", "alice"))
    mine = Socket(h, "same", "alice")
    theirs = Socket(h, "same", "bob")
    other_tab = Socket(h, "other", "alice")
    everyone = (mine, theirs, other_tab)
    await until(lambda: all(s.texts() for s in everyone))  # each socket's opening status
    assert mine.texts()[0]["data"] == {
        "status": {"exec_info": {"queue_remaining": 1}},
        "sid": "same",
    }
    h.route("p-alice", "same")("executing", '{"type": "executing"}')
    h.route("p-alice", "same")("preview", b"\x00\x00\x00\x01preview")
    # A prompt with no client_id: what ComfyUI broadcasts, to every socket of its caller.
    h.route("p-alice", None)("progress", '{"type": "progress"}')
    h.route("p-alice", None)("execution_success", '{"type": "execution_success"}')
    h.route("gone", "same")("progress", '{"type": "progress"}')  # no such request: dropped
    await until(lambda: len(mine.sent) >= 5 and len(other_tab.sent) >= 3)
    assert [m["type"] for m in mine.texts()[1:]] == ["executing", "progress"]
    assert [m.get("bytes") for m in mine.sent if m.get("bytes")] == [b"\x00\x00\x00\x01preview"]
    assert [m["type"] for m in other_tab.texts()[1:]] == ["progress"]
    assert [m["type"] for m in theirs.texts()] == ["status"]
    for s in everyone:
        await s.close()


async def test_the_newest_socket_takes_a_client_id_over_as_in_comfyui() -> None:
    h = hub(("p", None))
    old, new = Socket(h, "x", None), Socket(h, "x", None)
    await until(lambda: old.texts() and new.texts())
    h.route("p", "x")("progress", '{"type": "progress"}')
    await until(lambda: len(new.texts()) == 2)
    assert len(old.texts()) == 1
    await old.close()  # the older one closing leaves the id with the newer
    h.route("p", "x")("progress", '{"type": "progress"}')
    await until(lambda: len(new.texts()) == 3)
    await new.close()


async def test_a_slow_socket_never_holds_up_the_probe_and_is_closed_saying_why() -> None:
    """A client that stops reading: relaying never waits for it, its previews
    are dropped first, and past BEHIND_MESSAGES it is closed with 1013; the
    other sockets get everything."""
    h = hub(("p", "alice"))
    slow, fast = Socket(h, "slow", "alice", stuck=True), Socket(h, "fast", "alice")
    await until(lambda: slow.sent and fast.texts())
    client = h._current[("alice", "slow")]
    for _ in range(PREVIEW_BEHIND + 5):
        h.route("p", "slow")("progress", '{"type": "progress"}')
    h.route("p", "slow")("preview", b"image")
    assert client.dropped == 1 and client.closing is None
    for _ in range(BEHIND_MESSAGES + 10):
        h.route("p", "slow")("progress", '{"type": "progress"}')
        h.route("p", "fast")("progress", '{"type": "progress"}')
        await asyncio.sleep(0)  # the fast one's writer runs meanwhile; the slow one's is stuck
    assert client.closing is not None
    code, reason = client.closing
    assert code == 1013 and "fell behind" in reason and "reconnect" in reason, reason
    assert not client.waiting and client.waiting_bytes == 0  # nothing held for it any more
    await until(lambda: len(fast.texts()) == BEHIND_MESSAGES + 11)
    await fast.close()
    slow.task.cancel()


async def test_a_caller_may_open_only_so_many_sockets(monkeypatch: Any) -> None:
    monkeypatch.setattr(comfyui_sockets, "SOCKETS_PER_CALLER", 2)
    h = hub()
    first, second = Socket(h, "a", "alice"), Socket(h, "b", "alice")
    await until(lambda: first.texts() and second.texts())
    third = Socket(h, "c", "alice")
    await asyncio.wait_for(third.task, 30)
    assert third.sent[0]["type"] in ("websocket.http.response.start", "websocket.close")
    bob = Socket(h, "c", "bob")  # another caller's count is its own
    await until(lambda: bob.texts())
    for s in (first, second, bob):
        await s.close()


def test_a_client_queue_keeps_order_and_counts_bytes() -> None:
    client = _Client("alice", "x", "alice")
    client.put("ab")
    client.put(b"cde", preview=True)
    assert list(client.waiting) == ["ab", b"cde"] and client.waiting_bytes == 5
