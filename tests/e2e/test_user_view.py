"""A user key sees nothing of other callers (issue 21, item 4), through `gpulane serve`
as a user starts it.

Two `user` keys (alice, bob) and an `admin` key; model X's `cmd` and `env` carry
planted secrets. Bob's job runs when alice's arrives, bob's next job is dispatched
ahead of hers and causes the swap she waits through, and she beats a batch job of
bob's. Then every GET route of the app's route table (read from the app that
`serve` builds, so a new route is walked without editing this test) is fetched
with alice's key, path parameters filled with alice's own request and model: no
body may hold bob's or the admin's request ids or labels, or a planted secret.
The same walk with the admin key must find them, so the scenario did make them.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.config import parse_config
from app.report.visibility import ANOTHER_CALLER
from app.runtime.log_buffer import LogBuffer
from app.runtime.scheduler import Scheduler
from app.store.engine import open_database
from app.store.memory_store import InMemoryEventStore
from app.web.app import create_app
from app.web.forward import Forwarder
from app.web.jobs import JobRunner
from app.web.proxy import Proxy
from app.web.serve import extra_routes
from tests.e2e.gateway import Gateway, poll

ALICE, BOB, ADMIN = "sk-alice-9d1f", "sk-bob-55e0", "sk-admin-7a3c"
ALICE_LABEL, BOB_LABEL, ADMIN_LABEL = "alice-lbl", "bob-lbl-6c", "ops-admin-lbl"
KEYS = {"alice": ALICE, "bob": BOB, "admin": ADMIN}
SECRET_CMD, SECRET_ENV = "s3cr3t-planted-cmd", "s3cr3t-planted-env"
FAKE = f"{sys.executable} -m tools.fake_upstream --port ${{PORT}}"

CONFIG = f"""\
apiKeys:
  - key: {ALICE}
    label: {ALICE_LABEL}
  - key: {BOB}
    label: {BOB_LABEL}
  - key: {ADMIN}
    label: {ADMIN_LABEL}
    role: admin
models:
  X:
    cmd: env UPSTREAM_TOKEN={SECRET_CMD} {FAKE} --name X
    env: ["API_SECRET={SECRET_ENV}"]
    checkEndpoint: /health
  Y:
    cmd: {FAKE} --name Y
    checkEndpoint: /health
"""

ASYNC = {"Prefer": "respond-async"}


def as_key(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


def submit(
    client: httpx.Client, who: str, model: str, priority: str = "normal", **fake: Any
) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "fake": fake}
    headers = ASYNC | as_key(who) | {"X-LlamaSwap-Priority": priority}
    r = client.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def status_of(client: httpx.Client, job_id: str) -> str:
    return str(client.get(f"/v1/jobs/{job_id}", headers=as_key("admin")).json()["status"])


def wait_status(client: httpx.Client, job_id: str, *want: str) -> None:
    poll(lambda: status_of(client, job_id) in want, f"{job_id} to be {want}")


# -- the route table ------------------------------------------------------------


def route_table(tmp: Path) -> list[str]:
    """Every path the app `serve` builds answers GET on (raw ASGI routes take any
    method), with its path parameters as written: `/v1/jobs/{job_id:str}`."""

    async def build() -> list[str]:
        config = parse_config(CONFIG)
        scheduler = Scheduler(config, InMemoryEventStore(), logs=LogBuffer())
        forwarder = Forwarder(config, scheduler)
        engine = open_database(str(tmp / "routes.db"))
        try:
            jobs = JobRunner(config, scheduler, forwarder, engine)
            app = create_app(
                config,
                scheduler,
                Proxy(config, scheduler, forwarder),
                LogBuffer(),
                engine=engine,
                extra_handlers=extra_routes(scheduler, jobs, engine),
            )
            return sorted(
                route.path
                for route in app.routes
                if "GET" in getattr(route, "methods", ()) or not getattr(route, "methods", ())
            )
        finally:
            await forwarder.close()
            engine.dispose()

    return asyncio.run(build())


def fill(path: str, request_id: str, model: str) -> list[str]:
    """The URLs to fetch for a route: its parameters filled with the viewer's own
    request and model, plus the query variants that widen what a listing shows."""
    values = {"request_id": request_id, "job_id": request_id, "model": model}
    values |= {"file_id": request_id, "batch_id": request_id, "response": "resp_" + request_id}
    values |= {"name": "main.js", "path": "openapi.json"}

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        assert name in values, f"{path}: add a value for the path parameter {name!r} here"
        return values[name]

    url = re.sub(r"\{(\w+)(?::\w+)?\}", one, path)
    if url == "/upstream":  # a mount: /upstream/MODEL/PATH
        return [f"/upstream/{model}/health", f"/upstream/{model}/slots"]
    extra = {
        "/ui/api/timeline": ["?whole=true"],
        "/ui/api/history": [f"?caller={BOB_LABEL}", "?limit=500"],
        "/api/activity": ["?limit=1000"],
        "/v1/jobs": ["?limit=1000"],
        "/ui/api/queue": ["?limit=500"],
    }
    return [url] + [url + query for query in extra.get(url, [])]


def fetch(client: httpx.Client, url: str, who: str) -> httpx.Response:
    """GET `url`; a stream that never ends (/logs/stream) is read for a moment."""
    timeout = httpx.Timeout(10, read=1.5)
    try:
        with client.stream("GET", url, headers=as_key(who), timeout=timeout) as r:
            body = b""
            try:
                for chunk in r.iter_bytes():
                    body += chunk
            except httpx.ReadTimeout:
                pass
    except httpx.ReadTimeout:  # no answer at all: a route must answer at once
        return httpx.Response(599, content=b"no response head within the read timeout")
    return httpx.Response(r.status_code, headers=r.headers, content=body)


def walk(client: httpx.Client, routes: list[str], who: str, rid: str) -> dict[str, httpx.Response]:
    seen = {}
    for route in routes:
        for url in fill(route, rid, "Y"):
            seen[url] = fetch(client, url, who)
    return seen


# -- the scenario ---------------------------------------------------------------


class World:
    def __init__(self, gw: Gateway, client: httpx.Client, routes: list[str]) -> None:
        self.gw, self.client, self.routes = gw, client, routes
        self.others: list[str] = []
        """Request ids of bob and the admin."""

    def run_holding(self) -> str:
        """Bob's job holds X while alice's job for Y waits behind bob's own job for Y
        (dispatched ahead of hers, so it causes the swap she waits through) and
        before bob's batch job; returns alice's job id, still waiting."""
        c = self.client
        hold = submit(c, "bob", "X", hang=True)
        wait_status(c, hold, "running")
        ahead = submit(c, "bob", "Y", delay=0.2)
        self.alice = submit(c, "alice", "Y")
        behind = submit(c, "bob", "Y", "batch")
        admin = submit(c, "admin", "Y")
        self.others += [hold, ahead, behind, admin]
        self.hold = hold
        self.ahead = ahead
        return self.alice

    def finish(self) -> None:
        c = self.client
        r = c.delete(f"/v1/jobs/{self.hold}", headers=as_key("bob"))
        assert r.status_code == 200, r.text
        for job in [*self.others[1:], self.alice]:
            wait_status(c, job, "completed")
        # Alice's own swap back to X, so she sees her own swap beside the others'.
        self.alice_x = submit(c, "alice", "X")
        wait_status(c, self.alice_x, "completed")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = Path(tmp_path_factory.mktemp("user_view"))
    routes = route_table(tmp)
    gw = Gateway(tmp, CONFIG).start()
    try:
        with gw.client() as client:
            yield World(gw, client, routes)
    finally:
        gw.stop()


def leaks(body: str, world: World) -> list[str]:
    secrets = [*world.others, BOB_LABEL, ADMIN_LABEL, SECRET_CMD, SECRET_ENV, BOB, ADMIN]
    return [s for s in secrets if s in body]


def test_a_user_key_sees_nothing_of_other_callers_on_any_route(world: World) -> None:
    assert "/ui/api/timeline" in world.routes and "/running" in world.routes
    alice = world.run_holding()
    while_waiting = walk(world.client, world.routes, "alice", alice)
    world.finish()
    after = walk(world.client, world.routes, "alice", alice)
    for phase, seen in (("waiting", while_waiting), ("after", after)):
        leaked = {url: found for url, r in seen.items() if (found := leaks(r.text, world))}
        assert not leaked, f"{phase}: {leaked}"
        failed = {url: (r.status_code, r.text) for url, r in seen.items() if r.status_code >= 500}
        assert not failed, phase

    # Alice still sees her own story, and what held her back without naming it.
    story = world.client.get(f"/api/requests/{alice}/explain", headers=as_key("alice")).json()
    assert story["request_id"] == alice and story["caller"] == ALICE_LABEL
    [running] = story["running_at_arrival"]
    assert running["request_id"] is None and running["another_caller"] is True
    [ahead] = story["ahead"]
    assert ahead["request_id"] is None and ahead["another_caller"] is True
    assert ahead["reason"] == "arrived_earlier"
    assert any(s["another_caller"] and s["to_model"] == "Y" for s in story["swaps"])
    timeline = world.client.get("/ui/api/timeline?whole=true", headers=as_key("alice")).json()
    mine = [s for s in timeline["swaps"] if s["request_id"] == world.alice_x]
    assert mine and not mine[0]["another_caller"]
    assert any(s["another_caller"] and s["request_id"] is None for s in timeline["swaps"])
    # Its decision's runner-up was another caller's: the raw event says so, with no id.
    events = world.client.get(f"/ui/api/requests/{alice}/events", headers=as_key("alice"))
    assert ANOTHER_CALLER in events.text


def test_the_admin_sees_what_the_user_does_not(world: World) -> None:
    """The scenario made what alice must not see: the admin's walk finds it."""
    if not world.others:
        pytest.skip("runs after the user's walk, which builds the scenario")
    c = world.client
    story = c.get(f"/api/requests/{world.alice}/explain", headers=as_key("admin")).text
    assert world.hold in story and world.ahead in story
    timeline = c.get("/ui/api/timeline?whole=true", headers=as_key("admin")).text
    assert world.hold in timeline and world.ahead in timeline
    events = c.get(f"/ui/api/requests/{world.alice}/events", headers=as_key("admin")).text
    assert ANOTHER_CALLER not in events and any(other in events for other in world.others)
    running = c.get("/running", headers=as_key("admin")).json()["running"]
    assert any(SECRET_CMD in r["cmd"] for r in running)
    assert BOB_LABEL in c.get("/metrics", headers=as_key("admin")).text
    for url in ("/metrics", "/logs", "/upstream/Y/health"):
        r = c.get(url, headers=as_key("alice"))
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required", url
