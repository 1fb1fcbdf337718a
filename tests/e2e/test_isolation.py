"""Isolation between callers (issue 12, item 3), through `gpulane serve` as a user
starts it, with two `user` keys (alice, bob) and one `admin` key.

Every route that reads, lists or cancels a request or job is tried with no
key, a wrong key, the owner's key, another user's key and the admin key: the
owner and the admin are allowed, the other user gets 404 (its request is not
revealed to exist), no key or a wrong one 401. The routes that concern the
whole server need the admin key: a user key gets 403 `admin_key_required`.
One gateway serves the whole module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.gateway import Gateway, fake_model, poll

ALICE, BOB, ADMIN, WRONG = "sk-alice-71c3", "sk-bob-2e98", "sk-admin-d04a", "sk-nobody-5555"
KEYS = {"alice": ALICE, "bob": BOB, "admin": ADMIN, "wrong": WRONG}
ASYNC = {"Prefer": "respond-async"}

CONFIG = f"""\
apiKeys:
  - key: {ALICE}
    label: alice
  - key: {BOB}
    label: bob
  - {ADMIN}
models:{fake_model("A").replace(chr(10), chr(10) + "  ")}
"""


def as_key(who: str | None) -> dict[str, str]:
    return {} if who is None else {"Authorization": f"Bearer {KEYS[who]}"}


def submit(client: httpx.Client, who: str, **fake: Any) -> str:
    """A durable job of `who`; its id."""
    body = {"model": "A", "messages": [{"role": "user", "content": "hi"}], "fake": fake}
    r = client.post("/v1/chat/completions", json=body, headers=ASYNC | as_key(who))
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def status_of(client: httpx.Client, job_id: str) -> str:
    return str(client.get(f"/v1/jobs/{job_id}", headers=as_key("admin")).json()["status"])


def wait_status(client: httpx.Client, job_id: str, want: str) -> None:
    """The read model follows the live state within a group commit."""
    poll(lambda: status_of(client, job_id) == want, f"{job_id} to be {want}")


class World:
    def __init__(self, gw: Gateway, client: httpx.Client) -> None:
        self.gw = gw
        self.client = client
        self.alice_done = submit(client, "alice", reply="alice's answer")
        self.bob_done = submit(client, "bob", reply="bob's answer")
        for job in (self.alice_done, self.bob_done):
            wait_status(client, job, "completed")

    @contextlib.contextmanager
    def lane_held(self) -> Iterator[str]:
        """The admin's hung job holds the lane, so jobs queued meanwhile stay open."""
        blocker = submit(self.client, "admin", hang=True)
        wait_status(self.client, blocker, "running")
        try:
            yield blocker
        finally:
            self.client.delete(f"/api/requests/{blocker}", headers=as_key("admin"))
            wait_status(self.client, blocker, "cancelled")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    gw = Gateway(Path(tmp_path_factory.mktemp("isolation")), CONFIG).start()
    try:
        with gw.client() as client:
            yield World(gw, client)
    finally:
        gw.stop()


def assert_refused_without_a_valid_key(client: httpx.Client, method: str, path: str) -> None:
    for who in (None, "wrong"):
        r = client.request(method, path, headers=as_key(who))
        assert r.status_code == 401, (method, path, who, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"


READS = ["/v1/jobs/{id}", "/v1/jobs/{id}/result", "/api/requests/{id}/explain"]


@pytest.mark.parametrize("route", READS)
def test_a_request_is_read_by_its_owner_and_an_admin_and_unknown_to_another_user(
    world: World, route: str
) -> None:
    client = world.client
    path = route.format(id=world.alice_done)
    assert_refused_without_a_valid_key(client, "GET", path)
    for who in ("alice", "admin"):
        r = client.get(path, headers=as_key(who))
        assert r.status_code == 200, (route, who, r.text)
        assert "alice's answer" in r.text or r.json()["caller"] == "alice"
    hidden = client.get(path, headers=as_key("bob"))
    assert hidden.status_code == 404, hidden.text
    assert hidden.json()["error"]["type"] == "not_found_error"
    # The same answer as an id that never existed: nothing tells bob it does.
    unknown = client.get(route.format(id="no-such-request"), headers=as_key("bob"))
    assert unknown.status_code == 404
    assert unknown.text.replace("no-such-request", world.alice_done) == hidden.text


def ids_listed(client: httpx.Client, route: str, who: str) -> set[str]:
    r = client.get(route, headers=as_key(who))
    assert r.status_code == 200, (route, who, r.text)
    doc = r.json()
    if route in QUEUES:
        return {e["request_id"] for e in doc["running"] + doc["waiting"]}
    return {e["id"] for e in doc["data"]}


QUEUES = ("/api/queue", "/ui/api/queue")


@pytest.mark.parametrize("route", ["/v1/jobs", "/api/activity", *QUEUES])
def test_a_listing_shows_a_user_only_its_own_requests(world: World, route: str) -> None:
    client = world.client
    assert_refused_without_a_valid_key(client, "GET", route)
    with world.lane_held() as blocker:
        alice_open, bob_open = submit(client, "alice"), submit(client, "bob")
        alice = ids_listed(client, route, "alice")
        bob = ids_listed(client, route, "bob")
        admin = ids_listed(client, route, "admin")
        if route in QUEUES:
            # Positions stay those of the whole queue: bob's job is behind alice's.
            waiting = client.get(route, headers=as_key("bob")).json()["waiting"]
            assert [(w["request_id"], w["position"]) for w in waiting] == [(bob_open, 2)]
    mine_a, mine_b = {alice_open}, {bob_open}
    if route not in QUEUES:  # finished requests are listed too
        mine_a, mine_b = mine_a | {world.alice_done}, mine_b | {world.bob_done}
    assert mine_a <= alice and not alice & (mine_b | {blocker})
    assert mine_b <= bob and not bob & (mine_a | {blocker})
    assert mine_a | mine_b | {blocker} <= admin


CANCELS = [("DELETE", "/v1/jobs/{id}"), ("DELETE", "/api/requests/{id}")]


@pytest.mark.parametrize(("method", "route"), CANCELS)
def test_a_request_is_cancelled_by_its_owner_or_an_admin_never_by_another_user(
    world: World, method: str, route: str
) -> None:
    client = world.client
    with world.lane_held():
        for canceller in ("alice", "admin"):
            job = submit(client, "alice")
            path = route.format(id=job)
            assert_refused_without_a_valid_key(client, method, path)
            refused = client.request(method, path, headers=as_key("bob"))
            assert refused.status_code == 404, refused.text
            assert status_of(client, job) == "queued"
            done = client.request(method, path, headers=as_key(canceller))
            assert done.status_code == 200, (canceller, done.text)
            wait_status(client, job, "cancelled")


ADMIN_ONLY = [
    ("GET", "/unload"),
    ("POST", "/api/models/unload"),
    ("POST", "/api/models/unload/A"),
    ("GET", "/logs"),
    ("GET", "/logs/stream"),
    ("GET", "/logs/stream/proxy"),
    ("GET", "/logs/stream/A"),
    ("GET", "/metrics"),
    ("GET", "/upstream/A/echo"),
    ("POST", "/upstream/A/echo"),
]


@pytest.mark.parametrize(("method", "path"), ADMIN_ONLY)
def test_server_wide_routes_need_an_admin_key(world: World, method: str, path: str) -> None:
    client = world.client
    assert_refused_without_a_valid_key(client, method, path)
    for who in ("alice", "bob"):
        r = client.request(method, path, headers=as_key(who))
        assert r.status_code == 403, (path, who, r.text)
        error = r.json()["error"]
        assert error["code"] == "admin_key_required"
        assert path in error["message"] and "admin" in error["message"]
    # A log stream never ends: its status is enough.
    with client.stream(method, path, headers=as_key("admin")) as r:
        assert r.status_code == 200, path


def test_an_idempotency_key_belongs_to_the_caller_that_sent_it(world: World) -> None:
    client = world.client
    body = {"model": "A", "messages": [{"role": "user", "content": "hi"}]}

    def post(who: str, content: str = "hi") -> httpx.Response:
        sent = body | {"messages": [{"role": "user", "content": content}]}
        headers = ASYNC | as_key(who) | {"Idempotency-Key": "shared-key-1"}
        return client.post("/v1/chat/completions", json=sent, headers=headers)

    first = post("alice")
    assert first.status_code == 202, first.text
    again = post("alice")
    assert (again.status_code, again.json()["id"]) == (200, first.json()["id"])
    # Bob's same key and body is bob's own new job, not alice's job or result.
    theirs = post("bob")
    assert theirs.status_code == 202, theirs.text
    assert theirs.json()["id"] != first.json()["id"]
    assert theirs.json()["caller"] == "bob"
    # A different body under alice's key: a conflict for alice only, never naming her job to bob.
    assert post("alice", "other").status_code == 409
    other = post("bob", "other")
    assert other.status_code == 409 and first.json()["id"] not in other.text
