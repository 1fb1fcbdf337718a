"""The priority header says what it did (issue 32): a value that cannot be
read still runs at 0, as the seeds' rule says, but the answer carries it back
as sent (`X-Gpulane-Priority-Requested`) with a warning naming what is
allowed, the log keeps it, explain says "asked 'urgent' (unreadable, used 0)",
and `interactive+2` reads as the config reads it. Through `gpulane serve`, as
a user sends it: the official openai client, and raw bytes where it refuses
to send them."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Callable

import openai

from tests.e2e.gateway import REPO, Gateway, fake_model

Start = Callable[[str], Gateway]

CONFIG = "models:" + fake_model("A").replace("\n", "\n  ") + "\n"
MESSAGES = [{"role": "user", "content": "hi"}]
UNREADABLE = ["urgent", "1.5", "99999999999999999999", "-1e3"]


def _client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _chat(client: openai.OpenAI, priority: str | None = None) -> openai.APIResponse[object]:
    headers = {} if priority is None else {"X-LlamaSwap-Priority": priority}
    return client.chat.completions.with_raw_response.create(  # type: ignore[return-value]
        model="A",
        messages=MESSAGES,  # type: ignore[arg-type]
        extra_headers=headers,
    )


def _explain(gw: Gateway, request_id: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "explain", request_id, "--db", str(gw.db)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_value_that_cannot_be_read_runs_at_0_and_comes_back_as_sent(gateway: Start) -> None:
    gw = gateway(CONFIG)
    client = _client(gw)
    ids = {}
    for value in UNREADABLE:
        raw = _chat(client, value)
        assert raw.http_response.status_code == 200
        assert raw.headers["x-gpulane-priority-granted"] == "0"
        assert raw.headers["x-gpulane-priority-requested"] == value
        warning = raw.headers["x-gpulane-priority-warning"]
        assert f"'{value}' could not be read" in warning
        assert "interactive+2" in warning and "64-bit integer" in warning  # what is allowed
        ids[value] = raw.headers["x-request-id"]
    read = _chat(client, "batch")  # counted: only the unreadable ones
    assert read.headers["x-gpulane-priority-requested"] == "-100"
    assert "x-gpulane-priority-warning" not in read.headers
    with gw.client() as http:
        metrics = http.get("/metrics").text
    assert f"\ngpulane_priority_ignored_total {len(UNREADABLE)}.0\n" in metrics
    rows = gw.wait_for(
        "SELECT data FROM events WHERE type = 'request_completed'", count=len(UNREADABLE) + 1
    )
    assert len(rows) == len(UNREADABLE) + 1
    for value, request_id in ids.items():
        (row,) = gw.sql(
            "SELECT data FROM events WHERE type = 'request_enqueued' AND request_id = ?",
            request_id,
        )
        enqueued = json.loads(row["data"])
        assert enqueued["priority_unreadable"] == value
        assert f"'{value}' could not be read" in enqueued["priority_ignored"]
        explained = _explain(gw, request_id)
        assert f"asked '{value}' (unreadable, used 0)" in explained
        assert "none requested" not in explained


def test_a_band_with_an_offset_reads_as_in_the_config(gateway: Start) -> None:
    gw = gateway(CONFIG)
    client = _client(gw)
    raw = _chat(client, "interactive+2")
    assert raw.headers["x-gpulane-priority-granted"] == "102"
    assert raw.headers["x-gpulane-priority-requested"] == "102"
    assert "x-gpulane-priority-warning" not in raw.headers
    plain = _chat(client)
    assert "x-gpulane-priority-requested" not in plain.headers
    assert "x-gpulane-priority-warning" not in plain.headers


def _response_head(gw: Gateway, priority: bytes) -> tuple[int, list[tuple[bytes, bytes]]]:
    """A chat request with this exact `X-LlamaSwap-Priority` value (httpx, and so
    the openai client, sends only ASCII): the status and the response's headers."""
    body = json.dumps({"model": "A", "messages": MESSAGES}).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nX-LlamaSwap-Priority: " + priority + b"\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    fields = (line.partition(b":") for line in head[1:])
    headers = [(name.strip().lower(), value.strip()) for name, _, value in fields]
    return int(head[0].split(b" ")[1]), headers


def test_no_value_can_break_or_forge_a_response_header(gateway: Start) -> None:
    gw = gateway(CONFIG)
    sent = {
        "срочно".encode(): r"\xd1\x81\xd1\x80\xd0\xbe\xd1\x87\xd0\xbd\xd0\xbe",  # UTF-8
        b"caf\xe9": r"caf\xe9",  # latin-1
        b"ur\tgent": r"ur\tgent",
        b"x" * 10_000: "x" * 64,  # the first 64 characters, no more
    }
    for value, echoed in sent.items():
        status, headers = _response_head(gw, value)
        assert status == 200
        requested = [v for k, v in headers if k == b"x-gpulane-priority-requested"]
        assert requested == [echoed.encode()]
        (warning,) = [v for k, v in headers if k == b"x-gpulane-priority-warning"]
        assert warning.isascii() and f"'{echoed}' could not be read".encode() in warning
        assert len(warning) < 500
    # Control characters never reach gpulane: the request is refused whole.
    status, headers = _response_head(gw, b"ur\x01gent")
    assert status == 400 and not any(k.startswith(b"x-gpulane-priority") for k, _ in headers)
