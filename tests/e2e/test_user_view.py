"""A user key sees nothing of other callers (issue 21, item 4), through `gpulane serve`
as a user starts it.

Two `user` keys (alice, bob) and an `admin` key; model X's `cmd` and `env` carry
planted secrets, and bob's answers a planted reply. Bob's job runs when alice's
arrives, bob's next job is dispatched ahead of hers and causes the swap she waits
through, and she beats a batch job of bob's; each of them also has a finished job,
a file, a batch and a background response. Then every route of the app's route
table (read from the app that `serve` builds; `ROUTES` says what each one shows,
and a route it does not name fails the test) is asked with its own method, while
alice waits and after everything has finished:

- with alice's key and her own ids: each answers 2xx (403 on admin routes), and
  no body holds bob's or the admin's ids, labels or answers, or a planted secret;
- with alice's key and bob's ids (of the right kind: his job, file, batch,
  response): 404 where a route shows one thing by its id;
- with the admin key and bob's ids: each answers 2xx, and every route that shows
  callers' things shows bob's, so the scenario did make what alice must not see.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
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
from app.web.model_routes import FORM_ROUTES, GET_ROUTES, JSON_ROUTES
from app.web.proxy import Proxy
from app.web.serve import extra_routes
from tests.e2e.gateway import Gateway, poll

ALICE, BOB, ADMIN = "sk-alice-9d1f", "sk-bob-55e0", "sk-admin-7a3c"
ALICE_LABEL, BOB_LABEL, ADMIN_LABEL = "alice-lbl", "bob-lbl-6c", "ops-admin-lbl"
KEYS = {"alice": ALICE, "bob": BOB, "admin": ADMIN}
SECRET_CMD, SECRET_ENV = "s3cr3t-planted-cmd", "s3cr3t-planted-env"
BOB_REPLY, BOB_CUSTOM_ID = "bobs-own-answer-3f7a", "bobs-line-8c21"
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
BOB_CHAIN, ALICE_CHAIN = "reel-bob-4471", "reel-alice"


def as_key(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


def chat(model: str, **fake: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "fake": fake}


def submit(
    client: httpx.Client,
    who: str,
    model: str,
    priority: str = "normal",
    chain: str | None = None,
    **fake: Any,
) -> str:
    headers = ASYNC | as_key(who) | {"X-LlamaSwap-Priority": priority}
    if chain is not None:
        headers["X-Gpulane-Chain"] = chain
    r = client.post("/v1/chat/completions", json=chat(model, **fake), headers=headers)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def status_of(client: httpx.Client, job_id: str) -> str:
    return str(client.get(f"/v1/jobs/{job_id}", headers=as_key("admin")).json()["status"])


def wait_status(client: httpx.Client, job_id: str, *want: str) -> None:
    poll(lambda: status_of(client, job_id) in want, f"{job_id} to be {want}")


def upload_batch(client: httpx.Client, who: str, custom_id: str, **fake: Any) -> tuple[str, str]:
    """A batch of one line for Y: (its input file's id, the batch's id)."""
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions"}
    line["body"] = chat("Y", **fake)
    r = client.post(
        "/v1/files",
        files={"file": ("input.jsonl", json.dumps(line).encode() + b"\n")},
        data={"purpose": "batch"},
        headers=as_key(who),
    )
    assert r.status_code == 200, r.text
    file_id = str(r.json()["id"])
    r = client.post(
        "/v1/batches",
        json={
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
        headers=as_key(who),
    )
    assert r.status_code == 200, r.text
    return file_id, str(r.json()["id"])


def background(client: httpx.Client, who: str, **fake: Any) -> str:
    body = {"model": "Y", "input": "hi", "background": True, "fake": fake}
    r = client.post("/v1/responses", json=body, headers=as_key(who))
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


# -- the route table ------------------------------------------------------------


def route_table(tmp: Path) -> list[str]:
    """Every path the app `serve` builds answers GET on, and its raw ASGI routes
    (llama-swap's model routes, each asked with its own method, and the /upstream
    mount), with their path parameters as written: `/v1/jobs/{job_id:str}`."""

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


# What each route shows, and so what it must answer (see the module docstring):
PAGE = "page"  # nobody's things (a shell, a schema, the model list): 2xx to anyone
LIST = "list"  # every caller's things: the admin sees bob's, alice only her own
LIVE = "live"  # what is queued, running or loaded now: as LIST while bob's job holds X
ONE = "one"  # one thing, by its id: 2xx to its caller and the admin, 404 to anyone else
ADMIN_ONLY = "admin only"  # the admin's only: 403 to a user key
MODEL = "model"  # dispatched by model to Y (llama-swap's routes): 2xx to anyone

ROUTES = {
    "/": PAGE,
    "/health": PAGE,
    "/models": PAGE,
    "/v1/models": PAGE,
    "/ui/api/info": PAGE,
    "/ui/api/models": PAGE,  # the models, their state and output: no caller's
    **dict.fromkeys(
        (
            "/schema",
            "/schema/elements",
            "/schema/oauth2-redirect.html",
            "/schema/openapi.json",
            "/schema/openapi.yaml",
            "/schema/openapi.yml",
            "/schema/rapidoc",
            "/schema/redoc",
            "/schema/swagger",
            "/schema/{path:str}",
        ),
        PAGE,
    ),
    **dict.fromkeys(
        (
            "/ui",
            "/ui/batches",
            "/ui/batches/{batch_id:str}",
            "/ui/chains",
            "/ui/chains/{chain_id:str}",
            "/ui/history",
            "/ui/models",
            "/ui/requests/{request_id:str}",
            "/ui/static/{name:str}",
            "/ui/timeline",
        ),
        PAGE,
    ),
    "/api/activity": LIST,
    "/ui/api/history": LIST,
    "/ui/api/timeline": LIST,
    "/v1/batches": LIST,
    "/api/chains": LIST,
    "/v1/files": LIST,
    "/v1/jobs": LIST,
    "/api/queue": LIVE,
    "/running": LIVE,
    "/ui/api/queue": LIVE,
    "/api/requests/{request_id:str}/explain": ONE,
    "/ui/api/requests/{request_id:str}/events": ONE,
    "/ui/api/batches/{batch_id:str}/lines": ONE,
    "/v1/batches/{batch_id:str}": ONE,
    "/api/chains/{chain_id:str}": ONE,
    "/v1/files/{file_id:str}": ONE,
    "/v1/files/{file_id:str}/content": ONE,
    "/v1/jobs/{job_id:str}": ONE,
    "/v1/jobs/{job_id:str}/result": ONE,
    "/v1/responses/{response:str}": ONE,
    "/logs": ADMIN_ONLY,
    "/logs/stream": ADMIN_ONLY,
    "/api/events": ADMIN_ONLY,
    "/logs/stream/{name:path}": ADMIN_ONLY,
    "/metrics": ADMIN_ONLY,
    "/unload": ADMIN_ONLY,
    "/upstream": ADMIN_ONLY,
    **dict.fromkeys((*JSON_ROUTES, *FORM_ROUTES, *GET_ROUTES), MODEL),
}
# Asked last, in this order: they load or unload models and add requests, so
# they change what the other routes show.
LAST = ("/upstream", "/unload")


def asked_when(path: str) -> tuple[int, int]:
    """Where a route comes in a walk: MODEL routes, then LAST, after the others."""
    if path in LAST:
        return 2, LAST.index(path)
    return int(ROUTES[path] == MODEL), 0


@dataclass(frozen=True)
class Ids:
    """One caller's things, of each kind a route's path names."""

    request: str  # a request /explain and /events tell of
    job: str  # a finished job, which has a result
    file: str
    batch: str
    response: str
    chain: str


@dataclass(frozen=True)
class Probe:
    method: str
    url: str
    kind: str
    asked: tuple[str, ...] = ()
    """The ids the URL names."""


def probes(path: str, ids: Ids) -> list[Probe]:
    """The requests that ask a route: its own method, its path parameters filled
    with `ids` (of the right kind), plus the query variants that widen what a
    listing shows."""
    kind = ROUTES[path]
    values = {"request_id": ids.request, "job_id": ids.job, "file_id": ids.file}
    values |= {"batch_id": ids.batch, "response": ids.response, "chain_id": ids.chain}
    values |= {"path": "openapi.json", "name": "Y" if path.startswith("/logs/") else "main.js"}
    ids_named = {"request_id", "job_id", "file_id", "batch_id", "response", "chain_id"}
    asked = tuple(values[name] for name in re.findall(r"\{(\w+)", path) if name in ids_named)

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        assert name in values, f"{path}: add a value for the path parameter {name!r} here"
        return values[name]

    url = re.sub(r"\{(\w+)(?::\w+)?\}", one, path)
    if kind == MODEL:
        if path in GET_ROUTES:
            return [Probe("GET", f"{url}?model=Y", kind)]
        return [Probe("POST", url, kind)]
    if url == "/upstream":  # a mount: /upstream/MODEL/PATH
        return [Probe("GET", f"/upstream/Y/{rest}", kind) for rest in ("health", "slots")]
    extra = {
        "/ui/api/timeline": ["?whole=true"],
        "/ui/api/history": [f"?caller={BOB_LABEL}", "?limit=500"],
        "/api/activity": ["?limit=1000"],
        "/v1/jobs": ["?limit=1000"],
        "/ui/api/queue": ["?limit=500"],
    }
    return [Probe("GET", url + query, kind, asked) for query in ["", *extra.get(url, [])]]


def fetch(client: httpx.Client, probe: Probe, who: str) -> httpx.Response:
    """Ask `probe`; a stream that never ends (/logs/stream) is read for a moment."""
    if probe.method == "POST":
        path = probe.url
        if path in FORM_ROUTES:
            files = {"file": ("a.wav", b"RIFF")}
            return client.post(path, files=files, data={"model": "Y"}, headers=as_key(who))
        body = {"model": "Y", "messages": [{"role": "user", "content": "hi"}]}
        body |= {"prompt": "hi", "input": "hi", "query": "hi", "documents": ["a"]}
        return client.post(path, json=body, headers=as_key(who))
    # Only a stream is cut at its first pause: any other answer is read whole, as
    # slowly as a loaded host gives it.
    endless = probe.url.startswith(("/logs/stream", "/api/events"))
    timeout = httpx.Timeout(30, read=3) if endless else httpx.Timeout(30)
    try:
        with client.stream(
            "GET", probe.url, headers=as_key(who), timeout=timeout, follow_redirects=True
        ) as r:
            content = b""
            try:
                for chunk in r.iter_bytes():
                    content += chunk
            except httpx.ReadTimeout:
                if not endless:
                    raise
    except httpx.ReadTimeout:  # no answer at all: a route must answer at once
        return httpx.Response(599, content=b"no response head within the read timeout")
    return httpx.Response(r.status_code, headers=r.headers, content=content)


Walk = dict[Probe, httpx.Response]


def walk(client: httpx.Client, routes: list[str], who: str, ids: Ids, *, phase: str) -> Walk:
    """Every route asked as `who` with `ids`. While alice waits, nothing that
    loads or unloads a model is asked (it would end the wait the walk looks at)."""
    order = sorted(routes, key=asked_when)
    seen = {}
    for path in order:
        # A user key is refused the admin's LAST routes before they act.
        acts = ROUTES[path] == MODEL or (path in LAST and who == "admin")
        if phase == "waiting" and acts:
            continue
        for probe in probes(path, ids):
            seen[probe] = fetch(client, probe, who)
    return seen


# -- the scenario ---------------------------------------------------------------


@dataclass
class World:
    gw: Gateway
    client: httpx.Client
    routes: list[str]
    walks: dict[tuple[str, str, str], Walk] = field(default_factory=dict)
    """(phase, who asks, whose ids) -> what each route answered."""
    others: list[str] = field(default_factory=list)
    """What only bob and the admin may see: their ids, bob's custom id and answer."""

    def run_holding(self) -> None:
        """Bob's job holds X while alice's job for Y waits behind bob's own job for Y
        (dispatched ahead of hers, so it causes the swap she waits through) and
        before bob's batch job. Each of them has a finished job, a file, a batch
        and a background response too, made after alice's job arrived."""
        c = self.client
        bob_done = submit(c, "bob", "Y", reply=BOB_REPLY)
        wait_status(c, bob_done, "completed")
        alice_done = submit(c, "alice", "Y")
        wait_status(c, alice_done, "completed")
        self.hold = submit(c, "bob", "X", chain=BOB_CHAIN, hang=True)
        wait_status(c, self.hold, "running")
        self.ahead = submit(c, "bob", "Y", delay=0.2)
        self.alice = submit(c, "alice", "Y", chain=ALICE_CHAIN)
        behind = submit(c, "bob", "Y", "batch")
        admin = submit(c, "admin", "Y")
        bob_file, bob_batch = upload_batch(c, "bob", BOB_CUSTOM_ID, reply=BOB_REPLY)
        alice_file, alice_batch = upload_batch(c, "alice", "alice-line")
        self.ids = {
            "bob": Ids(
                self.hold,
                bob_done,
                bob_file,
                bob_batch,
                background(c, "bob", reply=BOB_REPLY),
                BOB_CHAIN,
            ),
            "alice": Ids(
                self.alice,
                alice_done,
                alice_file,
                alice_batch,
                background(c, "alice"),
                ALICE_CHAIN,
            ),
        }
        bob = self.ids["bob"]
        self.others += [bob_done, self.hold, self.ahead, behind, admin]
        self.others += [bob.file, bob.batch, bob.response, bob.chain, BOB_CUSTOM_ID, BOB_REPLY]
        self.jobs = [self.ahead, self.alice, behind, admin]

    def finish(self) -> None:
        c = self.client
        r = c.delete(f"/v1/jobs/{self.hold}", headers=as_key("bob"))
        assert r.status_code == 200, r.text
        for job in self.jobs:
            wait_status(c, job, "completed")
        for ids in self.ids.values():
            poll(
                lambda ids=ids: (
                    c.get(f"/v1/batches/{ids.batch}", headers=as_key("admin")).json()["status"]
                    == "completed"
                ),
                f"batch {ids.batch} to complete",
            )
            poll(
                lambda ids=ids: (
                    c.get(f"/v1/responses/{ids.response}", headers=as_key("admin")).json()["status"]
                    == "completed"
                ),
                f"response {ids.response} to complete",
            )
        # Alice's own swap back to X, so she sees her own swap beside the others'.
        self.alice_x = submit(c, "alice", "X")
        wait_status(c, self.alice_x, "completed")

    def walk_all(self, phase: str) -> None:
        # The admin first: alice's MODEL requests would push bob's off a first page.
        for who, whose in (("admin", "bob"), ("alice", "alice"), ("alice", "bob")):
            self.walks[phase, who, whose] = walk(
                self.client, self.routes, who, self.ids[whose], phase=phase
            )


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """The whole scenario, walked while alice waits and after: each test of this
    module reads it, so any one of them runs alone."""
    tmp = Path(tmp_path_factory.mktemp("user_view"))
    routes = route_table(tmp)
    gw = Gateway(tmp, CONFIG).start()
    try:
        with gw.client() as client:
            world = World(gw, client, routes)
            world.run_holding()
            world.walk_all("waiting")
            world.finish()
            world.walk_all("after")
            yield world
    finally:
        gw.stop()


def leaks(body: str, world: World) -> list[str]:
    secrets = [*world.others, BOB_LABEL, ADMIN_LABEL, SECRET_CMD, SECRET_ENV, BOB, ADMIN]
    return [s for s in secrets if s in body]


def shown(probe: Probe, r: httpx.Response) -> str:
    return f"{probe.method} {probe.url} -> {r.status_code} {r.text[:200]}"


def test_every_route_says_what_it_shows(world: World) -> None:
    missing = sorted(set(world.routes) - set(ROUTES))
    assert not missing, f"say in ROUTES what these routes show: {missing}"
    assert "/ui/api/timeline" in world.routes and "/running" in world.routes


def test_a_user_key_sees_nothing_of_other_callers_on_any_route(world: World) -> None:
    for phase in ("waiting", "after"):
        for probe, r in world.walks[phase, "alice", "alice"].items():
            if probe.kind == ADMIN_ONLY:
                assert r.status_code == 403, shown(probe, r)
                assert r.json()["error"]["code"] == "admin_key_required", shown(probe, r)
            else:
                assert 200 <= r.status_code < 300, (phase, shown(probe, r))
            assert not leaks(r.text, world), (phase, shown(probe, r), leaks(r.text, world))
        for probe, r in world.walks[phase, "alice", "bob"].items():
            if probe.kind == ONE:
                assert r.status_code == 404, (phase, shown(probe, r))
            # Bob's ids are alice's question: an answer may name only them.
            found = set(leaks(r.text, world)) - set(probe.asked)
            assert not found, (phase, shown(probe, r), found)

    # Alice still sees her own story, and what held her back without naming it.
    alice = world.alice
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
    """The scenario made what alice must not see: the admin's walk finds it on
    every route that shows callers' things."""
    for phase in ("waiting", "after"):
        for probe, r in world.walks[phase, "admin", "bob"].items():
            assert 200 <= r.status_code < 300, (phase, shown(probe, r))
            if probe.kind in (LIST, ONE) or (probe.kind == LIVE and phase == "waiting"):
                assert leaks(r.text, world), (phase, "shows nothing of bob's", shown(probe, r))
    c = world.client
    story = c.get(f"/api/requests/{world.alice}/explain", headers=as_key("admin")).text
    assert world.hold in story and world.ahead in story
    timeline = c.get("/ui/api/timeline?whole=true", headers=as_key("admin")).text
    assert world.hold in timeline and world.ahead in timeline
    events = c.get(f"/ui/api/requests/{world.alice}/events", headers=as_key("admin")).text
    assert ANOTHER_CALLER not in events and any(other in events for other in world.others)
    waiting = {p.url: r for p, r in world.walks["waiting", "admin", "bob"].items()}
    assert any(SECRET_CMD in r["cmd"] for r in waiting["/running"].json()["running"])
    assert BOB_LABEL in waiting["/metrics"].text
