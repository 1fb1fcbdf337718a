"""`logRequests` (llama-swap's key, issue 32): an access line per request at info,
off when the key is false or absent, and a reload (SIGHUP) turns it on or off.
A real `gpulane serve`, its log read as a user reads it."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

from websockets.sync.client import connect

from tests.e2e.gateway import Gateway, fake_model
from tests.e2e.test_reload import config, port_of, reloads, start
from tests.e2e.test_serve_admin import chat, wait_until

LINE = re.compile(
    r'INFO gpulane\.access: Request (?P<client>\S+) "(?P<method>\S+) (?P<path>\S+) HTTP/1\.1" '
    r'(?P<status>\S+) (?P<bytes>\d+) "(?P<agent>[^"]*)" (?P<seconds>[\d.]+)s '
    r"model=(?P<model>\S+) id=(?P<id>\S+)$"
)


def access_lines(gw: Gateway) -> list[dict[str, str]]:
    return [m.groupdict() for m in map(LINE.search, gw.log.read_text().splitlines()) if m]


WS_MODEL = f"""
W:
  cmd: {sys.executable} -m tests.e2e.ws_upstream --port ${{PORT}}
  checkEndpoint: /health
"""


def test_log_requests_prints_a_line_per_request_and_follows_reloads(tmp_path: Path) -> None:
    gw = start(tmp_path, config(fake_model("A"), WS_MODEL))  # no logRequests: off
    base = port_of(gw)
    try:
        with gw.client(headers={"User-Agent": "access-test"}) as client:
            assert client.post("/v1/chat/completions", json=chat("A")).status_code == 200
            assert access_lines(gw) == []

            gw.config.write_text(
                "logRequests: true\n" + config(fake_model("A"), WS_MODEL, start_port=base)
            )
            assert gw.proc is not None
            gw.proc.send_signal(signal.SIGHUP)
            reloads(gw)
            served = client.post("/v1/chat/completions", json=chat("A", delay=0.3))
            assert served.status_code == 200
            unknown = client.post("/v1/chat/completions", json=chat("nope"))
            assert unknown.status_code == 404
            assert client.get("/v1/models").status_code == 200  # a Litestar handler
            assert client.get("/upstream/A/health").status_code == 200  # a mounted ASGI app
            assert client.get("/no/such/route").status_code == 404
            with connect(gw.url.replace("http", "ws") + "/upstream/W/ws", open_timeout=30) as ws:
                ws.recv(timeout=30)  # its hello
                ws.send("echo")
                assert ws.recv(timeout=30) == "echo"
            wait_until(lambda: len(access_lines(gw)) >= 6)
            lines = access_lines(gw)
            assert [(x["method"], x["path"], x["status"]) for x in lines] == [
                ("POST", "/v1/chat/completions", "200"),
                ("POST", "/v1/chat/completions", "404"),
                ("GET", "/v1/models", "200"),
                ("GET", "/upstream/A/health", "200"),
                ("GET", "/no/such/route", "404"),
                ("GET", "/upstream/W/ws", "101"),
            ]
            chat_line, refused, models, upstream = lines[:4]
            assert (chat_line["model"], chat_line["id"]) == ("A", served.headers["x-request-id"])
            assert float(chat_line["seconds"]) >= 0.3
            assert int(chat_line["bytes"]) == len(served.content)
            assert (chat_line["client"], chat_line["agent"]) == ("127.0.0.1", "access-test")
            # A refusal's id is its request_rejected record's (app/web/refusals.py).
            assert (refused["model"], refused["id"]) == ("nope", unknown.headers["x-request-id"])
            assert (models["model"], models["id"]) == ("-", "-")
            assert upstream["model"] == "A"
            assert lines[5]["model"] == "W" and int(lines[5]["bytes"]) > len("echo")

            gw.config.write_text(
                "logRequests: false\n" + config(fake_model("A"), WS_MODEL, start_port=base)
            )
            gw.proc.send_signal(signal.SIGHUP)
            reloads(gw, count=2)
            assert client.post("/v1/chat/completions", json=chat("A")).status_code == 200
            assert client.get("/v1/models").status_code == 200
    finally:
        gw.stop()
    assert len(access_lines(gw)) == 6  # stopped: every line it would write is written
