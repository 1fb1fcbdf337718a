"""Callers (issue 12): who a request is from, what priority its key grants it, and
credentials that are never stored or forwarded, through `gpulane serve` as a
user starts it (tests/e2e/gateway.py) in front of tools.fake_upstream.

The design's tier example: a `free` key capped at normal+0, a `max` key allowed
interactive+2 and a batch producer whose requests default to -98. While a hung
request holds the lane, each caller queues requests; the queue and the
dispatch order follow the granted priorities, `explain` shows what was asked
and what was granted, and afterwards no key or credential header value is in
the database, the log or what the upstream received.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import contextlib
import io
import json
from collections.abc import Callable
from typing import Any

import httpx

from app import cli
from tests.e2e.gateway import Gateway, fake_model, poll

Start = Callable[[str], Gateway]

FREE, MAX, PRODUCER, ADMIN = (
    "sk-free-4b1d9e",
    "sk-max-8c2f0a",
    "sk-producer-3e7b51",
    "sk-admin-90d4c6",
)
# Credentials a client may send for some other service; none may leak.
API_KEY_VALUE = "azure-secret-5f1e"
COOKIE_VALUE = "session=cookie-secret-7a2c"
GOOG_VALUE = "goog-secret-1d8b"
ADMIN_BASIC = base64.b64encode(f"ops:{ADMIN}".encode()).decode()
SECRETS = (FREE, MAX, PRODUCER, ADMIN, API_KEY_VALUE, COOKIE_VALUE, GOOG_VALUE, ADMIN_BASIC)
LEAKY = {"api-key": API_KEY_VALUE, "cookie": COOKIE_VALUE, "x-goog-api-key": GOOG_VALUE}


def models(*entries: tuple[str, str]) -> str:
    """`models:` with fake upstreams; each entry is (id, extra YAML lines for it)."""
    out = "models:"
    for name, extra in entries:
        out += (fake_model(name) + extra).replace("\n", "\n  ")
    return out + "\n"


TIER_CONFIG = f"""\
apiKeys:
  - key: {FREE}
    label: free
    maxPriority: normal+0
  - key: {MAX}
    label: max
    maxPriority: interactive+2
  - key: {PRODUCER}
    label: producer
    defaultPriority: -98
  - {ADMIN}
routing:
  scheduler:
    settings:
      serial:
        agingDivisor: 0
        swapAffinityBonus: 0
""" + models(("A", ""), ("B", "  passCredentials: [api-key]\n"))


def as_key(key: str, way: str = "bearer") -> dict[str, str]:
    if way == "x-api-key":
        return {"x-api-key": key}
    return {"Authorization": f"Bearer {key}"}


ADMIN_HEADERS = {"Authorization": f"Basic {ADMIN_BASIC}"}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "A", "messages": [{"role": "user", "content": "hi"}], **extra}


def queue(client: httpx.Client) -> dict[str, Any]:
    r = client.get("/api/queue", headers=ADMIN_HEADERS)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def wait_waiting(client: httpx.Client, count: int, name: str) -> None:
    poll(lambda: len(queue(client)["waiting"]) == count, f"{name} to be queued")


# (name, key, how it presents the key, priority header, body service_tier)
PLAN = [
    ("p1", PRODUCER, "bearer", None, None),  # nothing asked: the producer's -98
    ("f1", FREE, "x-api-key", "interactive", None),  # asks 100, capped at 0
    ("m1", MAX, "bearer", "102", None),  # interactive+2: allowed
    ("f2", FREE, "bearer", None, "priority"),  # service_tier priority (100), capped at 0
    ("m2", MAX, "bearer", "200", None),  # above its cap: lowered to 102
    ("p2", PRODUCER, "bearer", "batch", "priority"),  # the header wins over the tier
    ("m3", MAX, "x-api-key", None, "flex"),  # service_tier flex: batch
    ("f3", FREE, "bearer", None, "auto"),  # auto: the key's default, 0
]
GRANTED = {"p1": -98, "f1": 0, "m1": 102, "f2": 0, "m2": 102, "p2": -100, "m3": -100, "f3": 0}
REQUESTED = {"p1": None, "f1": 100, "m1": 102, "f2": 100, "m2": 200, "p2": -100, "m3": -100}
CALLER = {"p": "producer", "f": "free", "m": "max"}
# Best granted priority first; equal ones (no aging, no affinity) in arrival order.
EXPECTED_ORDER = ["m1", "m2", "f1", "f2", "f3", "p1", "p2", "m3"]


def send(client: httpx.Client, key: str, way: str, priority: str | None, tier: str | None) -> Any:
    headers = as_key(key, way) | LEAKY
    if priority is not None:
        headers["X-LlamaSwap-Priority"] = priority
    body = chat() if tier is None else chat(service_tier=tier)
    return client.post("/v1/chat/completions", json=body, headers=headers)


def test_the_tier_example_orders_callers_by_the_priority_their_keys_grant(
    gateway: Start,
) -> None:
    gw = gateway(TIER_CONFIG)
    with cf.ThreadPoolExecutor(len(PLAN) + 1) as pool, gw.client() as client:
        # A hung request holds the lane until the operator cancels it.
        blocker = pool.submit(
            client.post,
            "/v1/chat/completions",
            json=chat(fake={"hang": True}),
            headers=as_key(ADMIN),
        )
        running = poll(lambda: queue(client)["running"], "the blocker to run")
        assert running[0]["caller"] == "key#4"  # a plain-string key, labelled by position
        futures = {}
        for count, (name, key, way, priority, tier) in enumerate(PLAN, start=1):
            futures[name] = pool.submit(send, client, key, way, priority, tier)
            wait_waiting(client, count, name)
        waiting = queue(client)["waiting"]
        blocker_id = running[0]["request_id"]
        cancelled = client.delete(f"/api/requests/{blocker_id}", headers=ADMIN_HEADERS)
        assert cancelled.status_code == 200, cancelled.text
        responses = {name: f.result() for name, f in futures.items()}
        blocker.result()

    ids = {}
    for name, r in responses.items():
        assert r.status_code == 200, (name, r.text)
        ids[name] = r.headers["x-request-id"]
        # What was asked and what was granted, in the response.
        assert r.headers["x-gpulane-priority-granted"] == str(GRANTED[name]), name
        assert r.headers.get("x-gpulane-priority-requested") == (
            None if REQUESTED.get(name) is None else str(REQUESTED[name])
        ), name
    names = {v: k for k, v in ids.items()}

    # The live queue showed the order and the callers before anything ran.
    assert [names[w["request_id"]] for w in waiting] == EXPECTED_ORDER
    assert [w["priority"] for w in waiting] == [GRANTED[n] for n in EXPECTED_ORDER]
    assert [w["caller"] for w in waiting] == [CALLER[n[0]] for n in EXPECTED_ORDER]

    rows = gw.wait_for(
        "SELECT id, caller, priority FROM requests WHERE status = 'completed' "
        "ORDER BY dispatched_at",
        count=len(PLAN),
    )
    assert [names[r["id"]] for r in rows] == EXPECTED_ORDER
    assert {names[r["id"]]: (r["caller"], r["priority"]) for r in rows} == {
        n: (CALLER[n[0]], GRANTED[n]) for n in GRANTED
    }

    with gw.client(headers=ADMIN_HEADERS) as client:
        # explain: requested and granted, as JSON and as text.
        lowered = client.get(f"/api/requests/{ids['m2']}/explain").json()
        assert (lowered["caller"], lowered["requested_priority"], lowered["priority"]) == (
            "max",
            200,
            102,
        )
        defaulted = client.get(f"/api/requests/{ids['p1']}/explain").json()
        assert (defaulted["requested_priority"], defaulted["priority"]) == (None, -98)
        capped = client.get(f"/api/requests/{ids['f2']}/explain").json()
        assert (capped["requested_priority"], capped["priority"], capped["band"]) == (
            100,
            0,
            "normal",
        )
        activity = {row["id"]: row for row in client.get("/api/activity").json()["data"]}
        assert {n: activity[i]["caller"] for n, i in ids.items()} == {n: CALLER[n[0]] for n in ids}
        metrics = client.get("/metrics").text
        # A durable job: its enqueue is on disk with no credential in it.
        job_headers = {"Prefer": "respond-async", "X-LlamaSwap-Priority": "9"}
        job = client.post(
            "/v1/chat/completions", json=chat(), headers=as_key(FREE) | LEAKY | job_headers
        )
        assert job.status_code == 202, job.text
        assert job.headers["x-gpulane-priority-granted"] == "0"
        assert job.headers["x-gpulane-priority-requested"] == "9"
        poll(
            lambda: client.get(f"/v1/jobs/{job.json()['id']}").json()["status"] == "completed",
            "the job to complete",
        )
        # What the upstreams received: no credential on A; on B only the one it passes.
        seen_a = client.get("/upstream/A/echo", headers=LEAKY | {"x-api-key": ADMIN}).json()
        seen_b = client.get("/upstream/B/echo", headers=LEAKY).json()
        logs = client.get("/logs").text
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert cli.main(["explain", ids["m2"], "--db", str(gw.db)]) == 0
    assert "priority granted 102: requested 200, lowered to the caller's maxPriority" in (
        text.getvalue()
    )

    assert 'gpulane_caller_requests_total{caller="free"} 3.0' in metrics
    assert 'gpulane_caller_priority_lowered_total{caller="free"} 2.0' in metrics
    assert 'gpulane_caller_priority_lowered_total{caller="max"} 1.0' in metrics
    assert 'gpulane_caller_queue_depth{caller="producer"} 0.0' in metrics

    received_a = {k.lower(): v for k, v in seen_a["headers"].items()}
    received_b = {k.lower(): v for k, v in seen_b["headers"].items()}
    assert received_a.keys().isdisjoint({"authorization", "x-api-key", *LEAKY}), received_a
    assert received_b.get("api-key") == API_KEY_VALUE  # passCredentials: [api-key]
    assert received_b.keys().isdisjoint({"authorization", "cookie", "x-goog-api-key"}), received_b

    gw.stop()  # flush every event to the database file before reading it
    stored = b"".join(p.read_bytes() for p in gw.db.parent.glob(gw.db.name + "*"))
    tables = [r["name"] for r in gw.sql("SELECT name FROM sqlite_master WHERE type = 'table'")]
    every_value = json.dumps(
        [[tuple(row) for row in gw.sql(f'SELECT * FROM "{t}"')] for t in tables], default=str
    )
    log_text = gw.log.read_text()
    assert "request_enqueued" in every_value and "A handled POST" in logs
    for secret in SECRETS:
        assert secret.encode() not in stored, secret
        assert secret not in every_value, secret
        assert secret not in log_text and secret not in logs, secret


NO_KEYS = models(("A", ""), ("B", "  passCredentials: false\n"))


def test_without_keys_x_gpulane_caller_names_the_caller_and_credentials_reach_the_upstream(
    gateway: Start,
) -> None:
    gw = gateway(NO_KEYS)
    with gw.client() as client:
        named = client.post(
            "/v1/chat/completions", json=chat(), headers={"X-Gpulane-Caller": "alice@lab"}
        )
        assert named.status_code == 200, named.text
        assert client.post("/v1/chat/completions", json=chat()).status_code == 200
        bad = client.post(
            "/v1/chat/completions", json=chat(), headers={"X-Gpulane-Caller": "alice smith"}
        )
        tier = client.post("/v1/chat/completions", json=chat(service_tier="scale"))
        # Without apiKeys gpulane checks no credential: the client's is for the
        # upstream, forwarded as llama-swap does, unless the model says no.
        creds = {"Authorization": "Bearer upstream-secret"} | LEAKY
        seen_a = client.get("/upstream/A/echo", headers=creds).json()["headers"]
        seen_b = client.get("/upstream/B/echo", headers=creds).json()["headers"]
        job = client.post(
            "/upstream/A/echo",
            headers=creds | {"Prefer": "respond-async", "X-Gpulane-Caller": "bob", "X-Custom": "1"},
        )
        assert job.status_code == 202, job.text
        done = poll(
            lambda: (
                (v := client.get(f"/v1/jobs/{job.json()['id']}").json())["status"] == "completed"
                and v
            ),
            "the job to complete",
        )
        metrics = client.get("/metrics").text
        explained = client.get(f"/api/requests/{named.headers['x-request-id']}/explain").json()

    assert bad.status_code == 400
    assert bad.json()["error"] == {
        "message": "header X-Gpulane-Caller 'alice smith' is not a caller label; expected "
        "1-64 characters of letters, digits and . _ - ~ @ : + # /",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_caller",
    }
    assert tier.status_code == 400
    assert tier.json()["error"]["message"] == (
        "service_tier 'scale' is not one of auto, default, flex, priority"
    )
    assert explained["caller"] == "alice@lab"
    assert done["caller"] == "bob"
    rows = gw.wait_for(
        "SELECT caller, status, http_status FROM requests "
        "WHERE endpoint = '/v1/chat/completions' ORDER BY enqueue_seq",
        count=4,
    )
    assert [tuple(r) for r in rows] == [
        ("alice@lab", "completed", 200),
        (None, "completed", 200),  # anonymous
        (None, "failed", 400),  # refused at admission: a bad caller header names no caller
        (None, "failed", 400),
    ]
    # Free-form callers are never metric labels: their number is unbounded.
    assert "alice" not in metrics and "gpulane_caller_requests_total" not in metrics

    received_a = {k.lower(): v for k, v in seen_a.items()}
    received_b = {k.lower(): v for k, v in seen_b.items()}
    assert received_a["authorization"] == "Bearer upstream-secret"
    assert {k: received_a[k] for k in LEAKY} == LEAKY
    assert received_b.keys().isdisjoint({"authorization", *LEAKY}), received_b
    # The job ran in this process with the credentials, which its stored
    # enqueue does not hold (a job run after a restart goes without them).
    ran_with = {k.lower(): v for k, v in done["result"]["body"]["headers"].items()}
    assert ran_with["authorization"] == "Bearer upstream-secret"
    (enqueue,) = gw.sql(
        "SELECT data FROM events WHERE type = 'request_enqueued' AND request_id = ?",
        job.json()["id"],
    )
    stored_headers = {k.lower() for k in json.loads(enqueue["data"])["job"]["headers"]}
    assert "x-custom" in stored_headers  # what a run after a restart needs is kept
    assert stored_headers.isdisjoint({"authorization", *LEAKY})
