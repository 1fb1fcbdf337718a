"""A route that raises answers 500 in the OpenAI error shape and logs its traceback.

gpulane has no route that raises on purpose, so these routes are the test's own,
given to create_app as `extra_handlers` the way serve adds the job routes."""

from __future__ import annotations

import logging

import httpx
import pytest
from litestar import asgi, get
from litestar.types import Receive, Scope, Send

from app.config import parse_config
from app.runtime.log_buffer import LogBuffer
from app.runtime.scheduler import Scheduler
from app.store.memory_store import InMemoryEventStore
from app.web.app import create_app
from app.web.forward import Forwarder
from app.web.proxy import Proxy

CONFIG = """
models:
  A:
    cmd: python -m tools.fake_upstream --port ${PORT}
"""


@get("/broken", sync_to_thread=False)
def broken() -> str:
    raise RuntimeError("the route broke")


@asgi("/broken-raw", is_mount=False, copy_scope=False)
async def broken_raw(scope: Scope, receive: Receive, send: Send) -> None:
    # As proxy.py's raw handlers would if something raised before the response.
    raise UnicodeEncodeError("ascii", "José", 3, 4, "ordinal not in range(128)")


@pytest.mark.parametrize(
    ("path", "kind"), [("/broken", "RuntimeError"), ("/broken-raw", "UnicodeEncodeError")]
)
async def test_an_exception_in_a_route_is_a_logged_500_in_the_openai_shape(
    path: str, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = parse_config(CONFIG)
    store = InMemoryEventStore()
    store.start()
    scheduler = Scheduler(config, store, logs=LogBuffer())
    proxy = Proxy(config, scheduler, Forwarder(config, scheduler))
    app = create_app(config, scheduler, proxy, LogBuffer(), extra_handlers=[broken, broken_raw])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gpulane") as client:
        with caplog.at_level(logging.ERROR, logger="gpulane.http"):
            r = await client.get(path)
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "internal_error"
        assert path in error["message"] and kind in error["message"]
        # The caller is told where to look, the operator finds the traceback there.
        [record] = [rec for rec in caplog.records if rec.name == "gpulane.http"]
        assert path in record.getMessage() and record.exc_info is not None
        assert record.exc_info[0] is not None and record.exc_info[0].__name__ == kind
        assert (await client.get("/health")).text == "OK"
    await store.close()
