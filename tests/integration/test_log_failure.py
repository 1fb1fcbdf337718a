"""When the event log cannot be written, new work is refused with a clear 503 and
a Retry-After, /health says why, and the server keeps answering; nothing is
queued that the log does not hold. (The real store on a full disk:
tests/e2e/test_disk_faults.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import httpx
import msgspec
import pytest

from app.config import parse_config
from app.core.events import AnyEvent, RequestEnqueued
from app.runtime.api import Admission
from app.runtime.log_buffer import LogBuffer
from app.runtime.scheduler import Scheduler
from app.store.memory_store import InMemoryEventStore
from app.store.port import StoreError
from app.web.app import create_app
from app.web.forward import Forwarder
from app.web.proxy import Proxy

CONFIG = """
models:
  A:
    cmd: python -m tools.fake_upstream --port ${PORT}
"""


class DiskFullStore(InMemoryEventStore):
    """Fails every write after `break_now()`, as SqliteEventStore does on a full disk."""

    def break_now(self) -> None:
        self.failure = "OperationalError: database or disk is full"

    def submit(self, events: Sequence[AnyEvent]) -> asyncio.Future[list[int]]:
        if self.failure is None:
            return super().submit(events)
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        future.set_exception(StoreError(self.failure))
        return future


async def test_unwritable_log_refuses_new_requests_with_503_and_keeps_serving() -> None:
    config = parse_config(CONFIG)
    store = DiskFullStore()
    store.start()
    scheduler = Scheduler(config, store, logs=LogBuffer())
    app = create_app(
        config,
        scheduler,
        Proxy(config, scheduler, Forwarder(config, scheduler)),
        LogBuffer(),
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gpulane") as client:
        store.break_now()
        r = await client.post("/v1/chat/completions", json={"model": "A", "messages": []})
        assert r.status_code == 503
        error = r.json()["error"]
        assert "disk is full" in error["message"] and error["code"] == "event_log_unavailable"
        assert int(r.headers["Retry-After"]) >= 1
        assert len(scheduler.state.queue) == 0 and not scheduler.state.running
        health = await client.get("/health")
        assert health.status_code == 503 and "disk is full" in health.text
        assert (await client.get("/metrics")).status_code == 200


class FailingCommitStore(InMemoryEventStore):
    """The commit of a durable enqueue fails after submission, as for an event
    the database cannot hold (a refusing database keeps it pending instead)."""

    def submit(self, events: Sequence[AnyEvent]) -> asyncio.Future[list[int]]:
        if not any(isinstance(e, RequestEnqueued) and e.durable for e in events):
            return super().submit(events)
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(
            future.set_exception, StoreError("request_enqueued of request r not stored: too large")
        )
        return future


async def test_a_durable_enqueue_that_fails_to_commit_leaves_no_phantom() -> None:
    config = parse_config(CONFIG)
    store = FailingCommitStore()
    store.start()
    scheduler = Scheduler(config, store, logs=LogBuffer())
    admission = Admission(
        model="A", model_requested="A", endpoint="/v1/chat/completions", priority=0, durable=True
    )
    # The lane is idle: before the fix this was dispatched at once, with no event on disk.
    ticket = scheduler.admit(admission)
    assert not scheduler.state.running and scheduler.state.loading is None
    assert ticket.committed is not None
    with pytest.raises(StoreError):
        await ticket.committed
    await asyncio.sleep(0)  # the scheduler's own commit callback runs next
    assert not scheduler.state.requests and len(scheduler.state.queue) == 0
    assert not scheduler.state.running and scheduler.state.loading is None
    stored = [type(e).__name__ for _, e in store.events]
    assert "RequestEnqueued" not in stored and "RequestDispatched" not in stored
    # The lane is free for the next request.
    normal = msgspec.structs.replace(admission, durable=False)
    nxt = scheduler.admit(normal)
    assert scheduler.state.running == {nxt.request_id: "A"}
    await scheduler.shutdown()
    # Its swap had not spawned the upstream yet: shutdown still leaves none running.
    pids = {type(e).__name__: e.pid for _, e in store.events if hasattr(e, "pid")}
    assert pids.get("ProcessStarted") == pids.get("ProcessStopped")
    assert not scheduler.loaded_models()
