"""The HTTP edges of `gpulane serve`: errors in the OpenAI shape, limits on the
request head, and deadlines for clients that stop half-way."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from collections.abc import Callable

import httpx

from app.web.limits import HEAD_TIMEOUT_S, MAX_HEAD_BYTES, MAX_HEADERS
from tests.e2e.gateway import Gateway, fake_model

Start = Callable[[str], Gateway]
CONFIG = "models:" + fake_model("A").replace("\n", "\n  ") + "\n"
CHAT = {"model": "A", "messages": [{"role": "user", "content": "hi"}]}


def assert_openai_error(r: httpx.Response, status: int, code: str) -> dict[str, str]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error


def raw_exchange(gw: Gateway, head: bytes, timeout: float = 10) -> tuple[int, bytes]:
    """Send `head` on a fresh connection; the status and body the server answers."""
    with socket.create_connection(("127.0.0.1", gw.port), timeout=timeout) as s:
        try:
            s.sendall(head)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before it read everything we sent: the answer is waiting
        data = read_until_closed(s)
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes; socket.timeout if it never does."""
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def head_with(headers: int, value: bytes = b"v", path: bytes = b"/health") -> bytes:
    lines = [b"GET " + path + b" HTTP/1.1", b"Host: gpulane", b"Connection: close"]
    lines += [b"X-H%d: %s" % (i, value) for i in range(headers - 2)]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def test_unknown_routes_and_wrong_methods_answer_in_the_openai_shape(gateway: Start) -> None:
    gw = gateway(CONFIG)
    with gw.client() as client:
        error = assert_openai_error(client.get("/v1/nope"), 404, "not_found")
        assert "/v1/nope" in error["message"]
        for method in ("GET", "PUT", "DELETE"):
            for path in ("/v1/chat/completions", "/v1/embeddings", "/v1/audio/transcriptions"):
                r = client.request(method, path)
                error = assert_openai_error(r, 405, "method_not_allowed")
                assert r.headers["allow"] == "POST"
                assert method in error["message"] and "POST" in error["message"]
        # Litestar's own routes too, with the methods they do allow.
        r = client.delete("/health")
        error = assert_openai_error(r, 405, "method_not_allowed")
        assert "GET" in r.headers["allow"] and "GET" in error["message"]
        error = assert_openai_error(client.get("/api/activity?limit=abc"), 400, "invalid_request")
        assert "'limit'" in error["message"]
        # Past SQLite's 64-bit OFFSET: an empty page, not a 500.
        r = client.get("/api/activity", params={"offset": str(10**30)})
        assert r.status_code == 200 and r.json()["data"] == []
        # POST, the one allowed method, still reaches the model.
        r = client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text


def test_too_many_or_too_large_headers_get_431_and_the_server_keeps_serving(
    gateway: Start,
) -> None:
    gw = gateway(CONFIG)
    assert raw_exchange(gw, head_with(MAX_HEADERS))[0] == 200

    status, body = raw_exchange(gw, head_with(MAX_HEADERS + 1, path=b"/v1/chat/completions"))
    assert status == 431
    error = httpx.Response(431, content=body, headers={"content-type": "application/json"})
    message = assert_openai_error(error, 431, "request_header_fields_too_large")["message"]
    assert f"at most {MAX_HEADERS}" in message

    # One header over the byte limit, and one that never ends: refused without the rest.
    big = head_with(3, value=b"a" * MAX_HEAD_BYTES)
    endless = b"GET /health HTTP/1.1\r\nHost: gpulane\r\nX-Big: " + b"a" * (4 * MAX_HEAD_BYTES)
    for head in (big, endless):
        status, body = raw_exchange(gw, head)
        assert status == 431
        assert f"at most {MAX_HEAD_BYTES}".encode() in body

    # A head the parser rejects gets a 400 in the same shape, not uvicorn's plain text.
    status, body = raw_exchange(gw, b"GET /health HTTP/1.1\r\nBad Header\r\n\r\n")
    assert status == 400 and b'"code":"invalid_http_request"' in body

    with gw.client() as client:
        assert client.get("/health").text == "OK"
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    # The refused chat request never reached the queue: the log holds the one that did.
    rows = gw.wait_for("SELECT id FROM requests")
    assert len(rows) == 1


def test_clients_that_stop_half_way_are_closed_within_the_head_deadline(gateway: Start) -> None:
    gw = gateway(CONFIG)
    partial = {
        "nothing sent": b"",
        "half a request line": b"POST /v1/chat/compl",
        "headers never finished": b"POST /v1/chat/completions HTTP/1.1\r\nHost: gpulane\r\n",
    }
    started = time.monotonic()
    # A request whose head is in may run past the head deadline: that is the model's time.
    slow_chat = concurrent.futures.ThreadPoolExecutor(1)
    long_run = slow_chat.submit(
        httpx.post,
        gw.url + "/v1/chat/completions",
        json={**CHAT, "fake": {"delay": HEAD_TIMEOUT_S + 1}},
        timeout=HEAD_TIMEOUT_S + 30,
    )
    sockets = {}
    for name, data in partial.items():
        s = socket.create_connection(("127.0.0.1", gw.port))
        s.sendall(data)
        sockets[name] = s
    # A slowloris: a byte at a time keeps the connection busy but not past the deadline.
    trickle = socket.create_connection(("127.0.0.1", gw.port))
    stop = threading.Event()

    def drip() -> None:
        for byte in b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 1000:
            if stop.wait(0.2):
                return
            try:
                trickle.sendall(bytes([byte]))
            except OSError:
                return

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    sockets["a byte every 0.2 s"] = trickle
    try:
        answers = {}
        for name, s in sockets.items():
            s.settimeout(max(0.1, started + HEAD_TIMEOUT_S + 10 - time.monotonic()))
            answers[name] = read_until_closed(s)  # socket.timeout here: never closed
            assert time.monotonic() - started < HEAD_TIMEOUT_S + 10, name
    finally:
        stop.set()
        dripper.join()
        for s in sockets.values():
            s.close()
    assert time.monotonic() - started >= HEAD_TIMEOUT_S - 1  # not cut short either
    assert answers["nothing sent"] == b""
    for name in ("half a request line", "headers never finished", "a byte every 0.2 s"):
        assert answers[name].startswith(b"HTTP/1.1 408 "), (name, answers[name])
        assert b'"code":"request_timeout"' in answers[name]
    assert long_run.result().status_code == 200
    slow_chat.shutdown()
    with gw.client() as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
