"""`/api/events` in llama-swap's framing and shapes, and what a slow client
costs (app/web/events_api.py); the stream itself is tested end to end in
tests/e2e/test_llama_swap_web.py. CORS's header echo (app/web/cors.py)."""

from __future__ import annotations

import json
import textwrap
from collections.abc import AsyncIterator
from typing import Any

import pytest

from app.config import parse_config
from app.runtime.log_buffer import LogBuffer
from app.runtime.scheduler import Scheduler
from app.store.memory_store import InMemoryEventStore
from app.web.cors import DEFAULT_ALLOW_HEADERS, allowed_headers
from app.web.events_api import QUEUE_LINES, envelope, event_stream, model_status

CONFIG = textwrap.dedent(
    """
    models:
      b:
        cmd: server --port ${PORT}
      a:
        cmd: server --port ${PORT}
        name: Model A
        description: the first
        aliases: [alpha]
        unlisted: true
    """
)


def scheduler() -> tuple[Any, Scheduler]:
    config = parse_config(CONFIG, environ={})
    return config, Scheduler(config, InMemoryEventStore(), logs=LogBuffer())


def decode(event: bytes) -> tuple[str, Any]:
    head, data = event.decode().split("\n")[:2]
    assert head == "event:message"
    wrapped = json.loads(data.removeprefix("data:"))
    assert set(wrapped) == {"type", "data"} and isinstance(wrapped["data"], str)
    return wrapped["type"], json.loads(wrapped["data"])


def test_an_event_is_llama_swaps_envelope_with_its_data_as_a_json_string() -> None:
    assert envelope("profileChanged", {"active": None}) == (
        b'event:message\ndata:{"type": "profileChanged", "data": "{\\"active\\":null}"}\n\n'
    )


async def test_model_status_lists_every_model_by_id_in_llama_swaps_fields() -> None:
    config, sched = scheduler()
    assert model_status(config, sched) == [
        {
            "id": "a",
            "name": "Model A",
            "description": "the first",
            "state": "stopped",
            "unlisted": True,
            "peerID": "",
            "aliases": ["alpha"],
        },
        {
            "id": "b",
            "name": "",
            "description": "",
            "state": "stopped",
            "unlisted": False,
            "peerID": "",
        },
    ]


async def _first(stream: AsyncIterator[bytes], n: int) -> list[tuple[str, Any]]:
    return [decode(await anext(stream)) for _ in range(n)]


async def test_the_stream_starts_with_history_then_state_and_ends_when_draining() -> None:
    config, sched = scheduler()
    logs = LogBuffer()
    logs.append("proxy", "one")
    logs.append("upstream:a", "two")
    stream = event_stream(config, sched, logs, poll_s=0.01)
    first = await _first(stream, 6)
    assert first[0] == ("logData", {"source": "proxy", "data": "one\n"})
    assert first[1] == ("logData", {"source": "upstream", "data": "two\n"})
    assert [kind for kind, _ in first[2:]] == [
        "modelStatus",
        "uiConfig",
        "profileChanged",
        "inflight",
    ]
    assert first[5][1] == {"operation": "snapshot", "requests": []}
    logs.append("proxy", "three")
    assert decode(await anext(stream)) == ("logData", {"source": "proxy", "data": "three\n"})
    sched.draining = True
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


async def test_a_slow_client_loses_the_oldest_lines_and_the_writer_never_waits() -> None:
    config, sched = scheduler()
    logs = LogBuffer()
    stream = event_stream(config, sched, logs, poll_s=60)
    await _first(stream, 6)
    # The client reads nothing while far more lines come than it may hold:
    # every append returns at once (it is synchronous, and never blocks on it).
    for i in range(QUEUE_LINES * 3):
        logs.append("proxy", f"line {i}")
    kind, data = decode(await anext(stream))
    # The oldest were dropped: the first line it gets is a recent one.
    assert kind == "logData" and data["data"] == f"line {QUEUE_LINES * 2}\n"
    await stream.aclose()


def test_cors_echoes_the_requested_headers_that_are_http_tokens() -> None:
    assert allowed_headers(b"authorization, Content-Type,,x-a b, x_ok") == (
        b"authorization, Content-Type, x_ok"
    )
    assert allowed_headers(None) == allowed_headers(b"") == DEFAULT_ALLOW_HEADERS
