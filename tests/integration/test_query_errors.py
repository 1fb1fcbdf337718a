"""Litestar's own validation of a route's typed query parameters answers in the
OpenAI shape with `param` naming the parameter and a message saying what it
takes (app/web/errors.py). The routes are gpulane's `/api/activity` and the
test's own, given to create_app as `extra_handlers` for each kind of value."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from litestar import get
from litestar.params import FromQuery

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


@get("/typed", sync_to_thread=False)
def typed(
    since: FromQuery[float | None] = None,
    whole: FromQuery[bool] = False,
    count: FromQuery[int] = 1,
) -> dict[str, object]:
    return {"since": since, "whole": whole, "count": count}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    config = parse_config(CONFIG)
    store = InMemoryEventStore()
    store.start()
    scheduler = Scheduler(config, store, logs=LogBuffer())
    proxy = Proxy(config, scheduler, Forwarder(config, scheduler))
    app = create_app(config, scheduler, proxy, LogBuffer(), extra_handlers=[typed])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gpulane") as c:
        yield c
    await store.close()


@pytest.mark.parametrize(
    ("url", "param", "given", "allowed"),
    [
        ("/api/activity?limit=abc", "limit", "'abc'", "an integer"),
        ("/api/activity?limit=10&offset=1.5", "offset", "'1.5'", "an integer"),
        ("/typed?since=yesterday", "since", "'yesterday'", "a number"),
        ("/typed?whole=maybe", "whole", "'maybe'", "true or false"),
    ],
)
async def test_a_bad_query_parameter_is_named_in_param(
    client: httpx.AsyncClient, url: str, param: str, given: str, allowed: str
) -> None:
    r = await client.get(url)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request"
    message = error["message"]
    assert f"query parameter {param!r}" in message and given in message
    assert allowed in message, message
    assert "got `str`" not in message  # msgspec's words: every query value is a string


async def test_several_bad_parameters_are_all_named_and_param_is_the_first(
    client: httpx.AsyncClient,
) -> None:
    r = await client.get("/typed?count=x&whole=y")
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "whole"
    assert "'whole'" in error["message"] and "'count'" in error["message"]


async def test_a_long_bad_value_is_cut_in_the_message(client: httpx.AsyncClient) -> None:
    r = await client.get("/api/activity?limit=" + "9x" * 5000)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "limit"
    assert len(error["message"]) < 400
