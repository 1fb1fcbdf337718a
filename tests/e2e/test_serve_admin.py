"""gpulane serve's admin routes, auth, rewriting and the fifo scheduler, through real HTTP.

Each test starts `gpulane serve` as a subprocess in front of tools.fake_upstream
processes (see gateway.py) and checks what a user would see: responses, the
SQLite log, /logs. Complements test_serve.py (serial dispatch order and faults);
the scheduling scenarios themselves (order, TTL, fifo, faults) are unit tests of
the run loop in tests/unit/test_scheduler.py.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.gateway import Gateway, fake_model

Start = Callable[[str], Gateway]

KEY = "sk-gpulane-e2e-7f3a9c"


def model(model_id: str, /, *args: str, **keys: Any) -> str:
    """One `models:` entry (indented) for a fake upstream; `keys` are extra YAML keys
    given in camelCase (`useModelName=...`), written as JSON, which YAML reads."""
    entry = fake_model(model_id, *args)
    for key, value in keys.items():
        entry += f"  {key}: {json.dumps(value)}\n"
    return entry.replace("\n", "\n  ")


def config(*models: str, **top: Any) -> str:
    """A config: top-level keys (as JSON values) and the given model entries
    (Gateway adds a free startPort)."""
    head = "".join(f"{key}: {json.dumps(value)}\n" for key, value in top.items())
    return head + "models:" + "".join(models) + "\n"


def chat(name: str, **fake: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
    if fake:
        body["fake"] = fake
    return body


def events(gw: Gateway, kind: str, count: int = 1, timeout: float = 30) -> list[dict[str, Any]]:
    """Events of one type, oldest first: `data` decoded, with `at` replaced by the
    column (unix seconds) and the `request_id` column as `_request_id`."""
    rows = gw.wait_for(
        "SELECT at, request_id, data FROM events WHERE type=? ORDER BY seq",
        kind,
        count=count,
        timeout=timeout,
    )
    return [json.loads(r["data"]) | {"at": r["at"], "_request_id": r["request_id"]} for r in rows]


def running(client: httpx.Client) -> list[dict[str, Any]]:
    return client.get("/running").json()["running"]  # type: ignore[no-any-return]


def wait_until(check: Callable[[], Any], timeout: float = 30, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)


# -- apiKeys ------------------------------------------------------------------------


def test_api_keys_guard_every_route_but_health(gateway: Start) -> None:
    gw = gateway(config(model("A"), apiKeys=[KEY, "sk-second-key"]))
    with gw.client() as anon:
        for method, path in (
            ("GET", "/v1/models"),
            ("POST", "/v1/chat/completions"),
            ("GET", "/running"),
            ("GET", "/logs"),
            ("GET", "/metrics"),
            ("GET", "/api/activity"),
            ("GET", "/upstream/A/echo"),
            ("GET", "/unload"),
            # llama-swap's routes (tests/e2e/test_llama_swap_routes.py).
            ("GET", "/models"),
            ("POST", "/v1/messages/count_tokens"),
            ("POST", "/v/chat/completions"),
            ("GET", "/props?model=A"),
            ("GET", "/logs/stream/proxy"),
            ("POST", "/api/models/unload/A"),
        ):
            r = anon.request(method, path, json=chat("A") if method == "POST" else None)
            assert r.status_code == 401, (path, r.text)
            assert "bearer" in r.headers["www-authenticate"].lower()
            assert r.json()["error"]["code"] == "invalid_api_key"
        wrong = anon.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"})
        assert wrong.status_code == 401
        assert anon.get("/health").text == "OK"
        basic = base64.b64encode(f"anyuser:{KEY}".encode()).decode()
        ways = {
            "bearer": {"Authorization": f"Bearer {KEY}"},
            "basic": {"Authorization": f"Basic {basic}"},
            "x-api-key": {"x-api-key": KEY},
        }
        ids = []
        for way, headers in ways.items():
            r = anon.post("/v1/chat/completions", json=chat("A"), headers=headers)
            assert r.status_code == 200, (way, r.text)
            ids.append(r.headers["x-request-id"])
            assert anon.get("/v1/models", headers=headers).status_code == 200, way
        # The key is not forwarded to the upstream either.
        echo = anon.get("/upstream/A/echo", headers=ways["bearer"]).json()
        assert {k.lower() for k in echo["headers"]}.isdisjoint({"authorization", "x-api-key"})
        logs = anon.get("/logs", headers=ways["x-api-key"]).text
    rows = gw.wait_for(
        "SELECT caller FROM requests WHERE status='completed' ORDER BY enqueued_at", count=4
    )
    assert {r["caller"] for r in rows} == {"key#1"}
    gw.stop()  # flush everything to the database file before reading its bytes
    secrets = (KEY.encode(), basic.encode())
    stored = b"".join(p.read_bytes() for p in Path(gw.db).parent.glob(gw.db.name + "*"))
    assert stored and not any(s in stored for s in secrets)
    assert "A handled POST" in logs and KEY not in logs and basic not in logs
    assert KEY not in gw.log.read_text()


# -- /upstream passthrough -------------------------------------------------------


def test_upstream_passthrough_forwards_get_and_post_to_the_model(gateway: Start) -> None:
    gw = gateway(config(model("A"), model("B")))
    with gw.client() as client:
        r = client.get("/upstream/B/props/x?full=1", headers={"X-Custom": "kept"})
        assert r.status_code == 200, r.text
        echo = r.json()
        assert (echo["method"], echo["path"], echo["served_by"]) == ("GET", "/props/x?full=1", "B")
        assert {k.lower(): v for k, v in echo["headers"].items()}["x-custom"] == "kept"
        assert r.headers["x-request-id"]
        payload = b'{"raw":  "bytes pass through",\n "n": 1.50}'
        r = client.post(
            "/upstream/B/slots/0?action=save",
            content=payload,
            headers={"content-type": "application/json"},
        )
        echo = r.json()
        assert (echo["method"], echo["path"]) == ("POST", "/slots/0?action=save")
        assert echo["body"] == payload.decode()
        assert [m["model"] for m in running(client)] == ["B"]
        # The path goes upstream as the client encoded it.
        assert client.get("/upstream/B/a%20b/c%2Fd").json()["path"] == "/a%20b/c%2Fd"
        missing = client.get("/upstream/nope/x")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
    row = gw.wait_for("SELECT endpoint FROM requests WHERE id=?", r.headers["x-request-id"])
    assert row[0]["endpoint"] == "/upstream/slots/0"


def test_static_asset_of_an_unloaded_model_gets_409_instead_of_a_swap(gateway: Start) -> None:
    gw = gateway(config(model("A"), model("B")))
    with gw.client() as client:
        assert client.post("/v1/chat/completions", json=chat("A")).status_code == 200
        for path in ("/upstream/B/favicon.ico", "/upstream/B/assets/app.js"):
            r = client.get(path)
            assert r.status_code == 409, (path, r.text)
            assert r.json()["error"]["code"] == "model_not_loaded"
        assert [m["model"] for m in running(client)] == ["A"]
        # The loaded model's static assets pass through.
        r = client.get("/upstream/A/favicon.ico")
        assert r.status_code == 200 and r.json()["served_by"] == "A"
    swaps = events(gw, "swap_started")
    assert [s["to_model"] for s in swaps] == ["A"]


# -- unload and TTL ----------------------------------------------------------------


def test_unload_answers_after_the_process_is_gone_and_ends_what_ran_on_it(
    gateway: Start,
) -> None:
    gw = gateway(config(model("A")))
    with gw.client() as client, cf.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(client.post, "/v1/chat/completions", json=chat("A", delay=30))
        pid = events(gw, "process_started")[0]["pid"]
        events(gw, "request_started")  # it runs on A now
        r = client.post("/api/models/unload/A")
        assert r.status_code == 200 and r.text == "OK"
        # llama-swap's unload blocks until the process has stopped: so does this.
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        answer = slow.result(timeout=10)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "model_unloaded"
        (failed,) = events(gw, "request_failed")
        assert "unloaded by an operator" in failed["error"]
        # The model loads again on demand.
        assert client.post("/v1/chat/completions", json=chat("A")).status_code == 200


def test_unload_routes_stop_idle_models(gateway: Start) -> None:
    gw = gateway(config(model("A"), model("B")))
    with gw.client() as client:
        assert client.post("/v1/chat/completions", json=chat("A")).status_code == 200
        assert client.get("/unload").text == "OK"
        assert running(client) == []
        stopped = events(gw, "process_stopped")
        assert [(e["model"], e["reason"]) for e in stopped] == [("A", "unload")]

        assert client.post("/v1/chat/completions", json=chat("B")).status_code == 200
        r = client.post("/api/models/unload/B")
        assert r.status_code == 200 and r.text == "OK"  # llama-swap's body
        assert running(client) == []
        stopped = events(gw, "process_stopped", count=2)
        assert [(e["model"], e["reason"]) for e in stopped] == [("A", "unload"), ("B", "unload")]

        assert client.post("/api/models/unload/nope").status_code == 404
        assert client.post("/api/models/unload").json() == {"msg": "ok"}  # llama-swap's
        # Unloaded models load again on demand.
        assert client.post("/v1/chat/completions", json=chat("A")).status_code == 200
        assert client.post("/api/models/unload").json() == {"msg": "ok"}
    assert len(events(gw, "process_stopped", count=3)) == 3
    assert gw.sql("SELECT count(*) AS n FROM processes WHERE stopped_at IS NULL")[0]["n"] == 0


def test_ttl_stops_a_model_once_it_has_been_idle_that_long(gateway: Start) -> None:
    # globalTTL would keep it a minute; the model's own ttl wins. (Busy models and
    # the exact countdown: tests/unit/test_scheduler.py.)
    gw = gateway(config(model("A", ttl=1), model("B"), globalTTL=60))
    with gw.client() as client:
        last = client.post("/v1/chat/completions", json=chat("A"))
        assert last.status_code == 200
        stopped = events(gw, "process_stopped", timeout=10)
        assert wait_until(lambda: running(client) == [], timeout=30)
        # Stopped by TTL, loaded again on demand.
        assert client.post("/v1/chat/completions", json=chat("A")).status_code == 200
    assert [(e["model"], e["reason"]) for e in stopped] == [("A", "ttl")]
    done = gw.sql("SELECT finished_at FROM requests WHERE id=?", last.headers["x-request-id"])
    assert stopped[0]["at"] - done[0]["finished_at"] >= 1.0


def test_preload_starts_a_model_at_launch(gateway: Start) -> None:
    hooks = {"on_startup": {"preload": ["bee"]}}  # an alias names the model too
    gw = gateway(config(model("A"), model("B", aliases=["bee"]), hooks=hooks))
    with gw.client() as client:
        assert wait_until(lambda: [(m["model"], m["state"]) for m in running(client)])
        assert wait_until(lambda: running(client)[0]["state"] == "ready")
        assert [m["model"] for m in running(client)] == ["B"]
        started = events(gw, "swap_started")
        assert events(gw, "swap_finished")
        assert [(s["to_model"], s["request_id"], s["_request_id"]) for s in started] == [
            ("B", None, None)
        ]
        states = {m["id"]: m["state"] for m in client.get("/v1/models").json()["data"]}
        assert states == {"A": "stopped", "B": "ready"}
        # The preloaded model serves without another swap.
        assert client.post("/v1/chat/completions", json=chat("B")).status_code == 200
    assert len(events(gw, "swap_started")) == 1


# -- /v1/models, /logs, /api/activity ---------------------------------------------------


def test_models_list_hides_unlisted_models_and_shows_their_state(gateway: Start) -> None:
    gw = gateway(
        config(
            model("A", name="Model A", description="first"), model("B"), model("H", unlisted=True)
        )
    )
    with gw.client() as client:
        data = client.get("/v1/models").json()["data"]
        assert [(m["id"], m["state"]) for m in data] == [("A", "stopped"), ("B", "stopped")]
        assert (data[0]["name"], data[0]["description"]) == ("Model A", "first")
        assert client.post("/v1/chat/completions", json=chat("A")).status_code == 200
        data = client.get("/v1/models").json()["data"]
        assert [(m["id"], m["state"]) for m in data] == [("A", "ready"), ("B", "stopped")]
        # Unlisted is hidden, not disabled.
        r = client.post("/v1/chat/completions", json=chat("H"))
        assert r.status_code == 200 and r.json()["served_by"] == "H"
        ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert ids == ["A", "B"]


def test_logs_hold_upstream_output_and_the_stream_replays_then_follows(gateway: Start) -> None:
    gw = gateway(config(model("A"), model("B")))
    with gw.client() as client:
        assert client.post("/v1/chat/completions", json=chat("A")).status_code == 200
        text = client.get("/logs").text
        assert "[upstream:A] A handled POST /v1/chat/completions" in text
        assert "[upstream:B]" not in text

        seen: list[str] = []
        subscribed = threading.Event()
        found = threading.Event()

        def follow() -> None:
            with (
                gw.client(timeout=30) as streamer,
                streamer.stream("GET", "/logs/stream") as r,
            ):
                assert r.status_code == 200
                subscribed.set()
                for line in r.iter_lines():
                    seen.append(line)
                    if "B handled POST" in line:
                        found.set()
                        return

        with cf.ThreadPoolExecutor(1) as pool:
            follower = pool.submit(follow)
            assert subscribed.wait(30)  # subscribed before the response starts
            assert client.post("/v1/chat/completions", json=chat("B")).status_code == 200
            assert found.wait(30), seen
            follower.result()
        assert "[upstream:B] B handled POST /v1/chat/completions" in seen
        # As in llama-swap, the lines held are replayed first, then the new ones.
        replayed = seen.index("[upstream:A] A handled POST /v1/chat/completions")
        assert replayed < seen.index("[upstream:B] B handled POST /v1/chat/completions")
        # A closed stream leaves the server serving.
        assert client.post("/v1/chat/completions", json=chat("B")).status_code == 200


def test_activity_lists_requests_newest_first_with_serial_fields(gateway: Start) -> None:
    gw = gateway(config(model("A"), model("B")))
    ids = []
    with gw.client() as client:
        for name, priority in (("A", "batch"), ("B", None), ("A", "interactive")):
            headers = {"X-LlamaSwap-Priority": priority} if priority else {}
            r = client.post("/v1/chat/completions", json=chat(name), headers=headers)
            ids.append(r.headers["x-request-id"])
        gw.wait_for("SELECT 1 FROM requests WHERE status='completed'", count=3)
        page = client.get("/api/activity").json()
        second = client.get("/api/activity", params={"limit": 1, "offset": 1}).json()
    rows = page["data"]
    assert [r["id"] for r in rows] == ids[::-1]
    assert [(r["serial_priority"], r["serial_band"]) for r in rows] == [
        (100, "interactive"),
        (0, "normal"),
        (-100, "batch"),
    ]
    for row in rows:
        assert row["status"] == "completed" and row["http_status"] == 200
        assert row["serial_score"] is not None and row["serial_queue_wait_ms"] >= 0
        assert row["run_ms"] > 0 and row["output_tokens"] >= 1
    assert rows[0]["model"] == "A" and rows[1]["model"] == "B"
    assert rows[0]["serial_score"] >= 100  # priority + affinity (+ aging)
    assert [r["id"] for r in second["data"]] == [ids[1]]
    assert (second["limit"], second["offset"]) == (1, 1)


# -- request rewriting -------------------------------------------------------------------


def test_multipart_transcription_is_routed_by_its_form_model_field(gateway: Start) -> None:
    gw = gateway(config(model("A"), model("B", aliases=["whisper-1"])))
    audio = b"RIFF\x00\x01fake-wave-data\xff"
    with gw.client() as client:
        for name in ("B", "whisper-1"):
            r = client.post(
                "/v1/audio/transcriptions",
                data={"model": name, "language": "en"},
                files={"file": ("a.wav", audio, "audio/wav")},
            )
            assert r.status_code == 200, r.text
            echo = r.json()
            assert (echo["served_by"], echo["path"]) == ("B", "/v1/audio/transcriptions")
            sent_type = {k.lower(): v for k, v in echo["headers"].items()}["content-type"]
            assert sent_type.startswith("multipart/form-data; boundary=")
            assert f'name="model"\r\n\r\n{name}\r\n' in echo["body"]  # the form is untouched
            assert "fake-wave-data" in echo["body"]
        r = client.post("/v1/audio/transcriptions", files={"file": ("a.wav", audio, "audio/wav")})
        assert r.status_code == 400 and "model" in r.json()["error"]["message"]
    rows = gw.wait_for(
        "SELECT model, model_requested FROM requests WHERE status='completed' ORDER BY enqueued_at",
        count=2,
    )
    assert [(r["model"], r["model_requested"]) for r in rows] == [("B", "B"), ("B", "whisper-1")]


def test_aliases_resolve_and_use_model_name_rewrites_the_body(gateway: Start) -> None:
    gw = gateway(
        config(
            model("A", aliases=["alpha", "gpt-4o"], useModelName="org/real-a:Q4"),
            model("B", aliases=["beta"]),
        )
    )
    with gw.client() as client:
        for name in ("A", "alpha", "gpt-4o"):
            r = client.post("/v1/chat/completions", json=chat(name))
            assert (r.json()["served_by"], r.json()["model"]) == ("A", "org/real-a:Q4"), name
        # Without useModelName the body passes through unchanged, alias included.
        r = client.post("/v1/chat/completions", json=chat("beta"))
        assert (r.json()["served_by"], r.json()["model"]) == ("B", "beta")
        r = client.post("/v1/chat/completions", json=chat("gamma"))
        assert r.status_code == 404
    rows = gw.wait_for(
        "SELECT model, model_requested FROM requests WHERE status='completed' ORDER BY enqueued_at",
        count=4,
    )
    assert [(r["model"], r["model_requested"]) for r in rows] == [
        ("A", "A"),
        ("A", "alpha"),
        ("A", "gpt-4o"),
        ("B", "beta"),
    ]


def test_filters_strip_and_set_params_and_leave_other_bodies_byte_for_byte(
    gateway: Start,
) -> None:
    filters = {"stripParams": "temperature, top_p", "setParams": {"max_tokens": 7, "seed": 42}}
    gw = gateway(config(model("A", filters=filters), model("B")))
    with gw.client() as client:
        sent = {"model": "A", "temperature": 0.9, "top_p": 0.5, "max_tokens": 900, "keep": [1]}
        r = client.post("/v1/rerank", json=sent)  # the fake echoes this route's body
        assert r.status_code == 200, r.text
        received = json.loads(r.json()["body"])
        assert received == {"model": "A", "max_tokens": 7, "keep": [1], "seed": 42}
        raw = b'{"model":"B",  "temperature": 1.50,\n"top_p":1e0}'
        r = client.post("/v1/rerank", content=raw, headers={"content-type": "application/json"})
        assert r.json()["body"].encode() == raw


# -- the fifo scheduler ------------------------------------------------------------------------


def fifo(*models: str) -> str:
    scheduler = {"use": "fifo", "settings": {"fifo": {"priority": {}}}}
    return config(*models, routing={"scheduler": scheduler})


def test_fifo_serves_the_ready_model_concurrently_up_to_its_limit(gateway: Start) -> None:
    gw = gateway(fifo(model("A", concurrencyLimit=3)))
    # Each runs until three run and three wait: sent at once, they may still
    # arrive far apart on a slow host, past any fixed run.
    release = gw.tmp / "release"
    with gw.client() as client:
        assert client.post("/v1/chat/completions", json=chat("A")).status_code == 200  # load
        with cf.ThreadPoolExecutor(6) as pool:
            sent = [
                pool.submit(
                    client.post, "/v1/chat/completions", json=chat("A", hold_file=str(release))
                )
                for _ in range(6)
            ]
            try:
                assert wait_until(
                    lambda: (
                        (q := client.get("/api/queue").json())
                        and (len(q["running"]), len(q["waiting"])) == (3, 3)
                    ),
                    timeout=30,
                ), client.get("/api/queue").text
            finally:
                release.touch()
            replies = [f.result(timeout=30) for f in sent]
    assert all(r.status_code == 200 for r in replies)
    ids = [r.headers["x-request-id"] for r in replies]
    marks = ",".join("?" * len(ids))
    rows = gw.wait_for(
        f"SELECT started_at, finished_at FROM requests WHERE id IN ({marks})"
        " AND status='completed'",
        *ids,
        count=6,
    )
    edges = sorted(
        [(r["started_at"], 1) for r in rows] + [(r["finished_at"], -1) for r in rows],
        key=lambda e: (e[0], e[1]),  # an end before a start at the same instant
    )
    in_flight = peak = 0
    for _, step in edges:
        in_flight += step
        peak = max(peak, in_flight)
    assert peak == 3  # three at once, never more


# -- a client that leaves mid-body --------------------------------------------------------------


def raw_request_then_hang_up(gw: Gateway, head: bytes, body_part: bytes, *, reset: bool) -> None:
    """Send the head and part of the body, then close (FIN, or RST when `reset`)."""
    with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as sock:
        sock.sendall(head + body_part)
        time.sleep(0.2)  # let the server start reading the body
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.mark.parametrize(
    "path",
    ["/v1/chat/completions", "/v1/audio/transcriptions", "/upstream/A/slots"],
)
def test_server_survives_a_client_that_disconnects_mid_body(gateway: Start, path: str) -> None:
    gw = gateway(config(model("A")))
    fixed = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 100000\r\n\r\n"
    ).encode()
    chunked = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    raw_request_then_hang_up(gw, fixed, b'{"model": "A", "messages": [', reset=False)
    raw_request_then_hang_up(gw, chunked, b'10\r\n{"model": "A", "\r\n', reset=True)
    with gw.client() as client:
        r = client.post("/v1/chat/completions", json=chat("A"))
        assert r.status_code == 200, r.text
        assert client.get("/health").text == "OK"
    assert gw.proc is not None and gw.proc.poll() is None
    gw.wait_for("SELECT 1 FROM requests WHERE status='completed'")
    open_rows = gw.sql("SELECT id FROM requests WHERE status IN ('queued', 'running')")
    assert open_rows == []
