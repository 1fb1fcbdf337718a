"""When the event log cannot be written, new work is refused with a clear 503 and
the server keeps answering; nothing is queued that the log does not hold."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import httpx

from app.config import parse_config
from app.core.events import AnyEvent
from app.runtime.log_buffer import LogBuffer
from app.runtime.scheduler import Scheduler
from app.store.memory_store import InMemoryEventStore
from app.store.port import StoreError
from app.web.app import create_app
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
    async with httpx.AsyncClient() as upstream_client:
        app = create_app(config, scheduler, Proxy(config, scheduler, upstream_client), LogBuffer())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gpulane") as client:
            store.break_now()
            r = await client.post("/v1/chat/completions", json={"model": "A", "messages": []})
            assert r.status_code == 503
            error = r.json()["error"]
            assert "disk is full" in error["message"] and error["code"] == "event_log_unavailable"
            assert len(scheduler.state.queue) == 0 and not scheduler.state.running
            assert (await client.get("/health")).text == "OK"
            assert (await client.get("/metrics")).status_code == 200
