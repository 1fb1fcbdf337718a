"""Hostile and careless requests (issue 21, items 5, 6 and 8) against `gpulane
serve` as a user starts it, in front of tools.fake_upstream: a bad body or
header is answered 400 in the OpenAI error shape, or passed through untouched,
never with a traceback; and every answer carries the security headers."""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Callable

import httpx
from openai import DefaultHttpxClient, OpenAI

from app.web.console.security import SECURITY_HEADERS
from app.web.request_body import MAX_JSON_DEPTH
from tests.e2e.gateway import Gateway, fake_model

Start = Callable[[str], Gateway]

WHISPER = fake_model("whisper") + '  useModelName: "org/whisper-large"\n'
CONFIG = "models:" + (fake_model("A") + WHISPER).replace("\n", "\n  ") + "\n"
CHAT = {"model": "A", "messages": [{"role": "user", "content": "hi"}]}
# Binary audio with the things a naive multipart reader trips on inside it.
AUDIO = b'RIFF\x00\xff\r\n\r\nContent-Disposition: form-data; name="model"\r\n\r\nx\r\n' * 50


def assert_openai_error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return str(error["message"])


def test_a_file_part_is_never_the_model_with_the_official_client(gateway: Start) -> None:
    gw = gateway(CONFIG)
    sent: list[bytes] = []
    # The openai client's own transport, with a hook that keeps each body it sends.
    http = DefaultHttpxClient(event_hooks={"request": [lambda req: sent.append(req.read())]})
    client = OpenAI(base_url=gw.url + "/v1", api_key="unused", http_client=http)
    # The file is called "model": its part says name="file"; filename="model".
    raw = client.audio.transcriptions.with_raw_response.create(
        model="whisper", file=("model", AUDIO, "audio/wav")
    )
    echo = json.loads(raw.text)
    assert echo["served_by"] == "whisper" and echo["path"] == "/v1/audio/transcriptions"
    # The upstream got the very body sent, with only the model field renamed.
    expected = sent[-1].replace(
        b'name="model"\r\n\r\nwhisper\r\n', b'name="model"\r\n\r\norg/whisper-large\r\n'
    )
    assert expected != sent[-1] and AUDIO in expected
    assert echo["body_sha256"] == hashlib.sha256(expected).hexdigest()
    http.close()

    # A file part first, the form field after it: the field chooses the model.
    boundary = "hostile-b0undary"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="model"\r\n'
        "Content-Type: audio/wav\r\n\r\n"
    ).encode()
    body += AUDIO + f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="model"'.encode()
    body += f"\r\n\r\nA\r\n--{boundary}--\r\n".encode()
    headers = {"content-type": f"multipart/form-data; boundary={boundary}"}
    with gw.client() as http_client:
        r = http_client.post("/v1/audio/transcriptions", content=body, headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["served_by"] == "A"
        assert r.json()["body_sha256"] == hashlib.sha256(body).hexdigest()
        # A file part named "model" is not the model field.
        only_file = body.split(f"\r\n--{boundary}\r\nContent-Disposition".encode())[0]
        only_file = only_file.replace(b'name="file"', b'name="model"') + b"\r\n--"
        only_file += f"{boundary}--\r\n".encode()
        r = http_client.post("/v1/audio/transcriptions", content=only_file, headers=headers)
        assert "no 'model' field" in assert_openai_error(r, 400, "missing_model")
    rows = gw.wait_for(
        "SELECT model, model_requested FROM requests WHERE status='completed' ORDER BY enqueued_at",
        count=2,
    )
    assert [(r["model"], r["model_requested"]) for r in rows] == [
        ("whisper", "whisper"),
        ("A", "A"),
    ]


def test_deep_json_is_a_400_naming_the_limit_sync_and_durable(gateway: Start) -> None:
    gw = gateway(CONFIG)
    deep = b'{"model": "A", "messages": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    assert len(deep) < 2100
    with gw.client() as client:
        for headers in ({}, {"Prefer": "respond-async"}):
            r = client.post(
                "/v1/chat/completions",
                content=deep,
                headers={"content-type": "application/json", **headers},
            )
            message = assert_openai_error(r, 400, "json_too_deep")
            assert str(MAX_JSON_DEPTH) in message
        # Up to the limit is fine.
        nested = b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1)
        ok = b'{"model": "A", "x": ' + nested + b', "messages": []}'
        r = client.post("/v1/chat/completions", content=ok)
        assert r.status_code == 200, r.text
    assert "Traceback" not in gw.log.read_text()


def test_nan_and_odd_max_wait_numbers_are_400s_naming_them(gateway: Start) -> None:
    gw = gateway(CONFIG)
    with gw.client() as client:
        for constant in ("NaN", "Infinity", "-Infinity"):
            body = b'{"model": "A", "messages": [], "temperature": ' + constant.encode() + b"}"
            r = client.post("/v1/chat/completions", content=body)
            assert constant in assert_openai_error(r, 400, "invalid_json")
        for value in ("1_0", "1e1", "+10", "Infinity"):
            r = client.post(
                "/v1/chat/completions", json=CHAT, headers={"X-Gpulane-Max-Wait": value}
            )
            message = assert_openai_error(r, 400, "invalid_max_wait")
            assert "X-Gpulane-Max-Wait" in message and "in plain digits" in message
        r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Gpulane-Max-Wait": "2.5"})
        assert r.status_code == 200, r.text
        # The priority header was strict already: `1_0` asks for nothing (priority 0),
        # and the answer says it could not be read.
        r = client.post("/v1/chat/completions", json=CHAT, headers={"X-LlamaSwap-Priority": "1_0"})
        assert r.status_code == 200 and r.headers["x-gpulane-priority-granted"] == "0"
        assert r.headers["x-gpulane-priority-requested"] == "1_0"
        assert "could not be read" in r.headers["x-gpulane-priority-warning"]
    assert "Traceback" not in gw.log.read_text()


def test_every_answer_has_the_security_headers_errors_and_redirect_included(
    gateway: Start,
) -> None:
    key = "sk-hostile-2b7e"
    gw = gateway(f"apiKeys: [{key}]\n" + CONFIG)
    auth = {"Authorization": f"Bearer {key}"}
    with gw.client(follow_redirects=False) as client:
        answers = {
            "/ redirect": client.get("/"),
            "401": client.get("/v1/models"),
            "401 inference": client.post("/v1/chat/completions", json=CHAT),
            "404 route": client.get("/nowhere", headers=auth),
            "404 model": client.post(
                "/v1/chat/completions", json=CHAT | {"model": "Z"}, headers=auth
            ),
            "400 body": client.post("/v1/chat/completions", content=b"{", headers=auth),
            "405": client.get("/v1/chat/completions", headers=auth),
            "200 proxied": client.post("/v1/chat/completions", json=CHAT, headers=auth),
            "200 health": client.get("/health"),
            "200 console": client.get("/ui/"),
        }
    assert answers["/ redirect"].status_code in (301, 302, 303, 307, 308)
    assert [answers[k].status_code for k in ("401", "401 inference", "404 route", "404 model")] == [
        401,
        401,
        404,
        404,
    ]
    for what, r in answers.items():
        for header in SECURITY_HEADERS:
            assert r.headers.get(header.name) == header.value, (what, header.name, r.headers)
        assert len(r.headers.get_list("content-security-policy")) == 1, what
    # Refused by the HTTP parser (431), before any route: the same headers.
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 200 + b"\r\n")
        head = b""
        while b"\r\n\r\n" not in head:  # each recv waits at most the socket's 10 s
            chunk = sock.recv(65536)
            assert chunk, f"closed before a whole response head: {head!r}"
            head += chunk
    assert head.startswith(b"HTTP/1.1 431 ")
    for header in SECURITY_HEADERS:
        line = f"\r\n{header.name}: {header.value}\r\n".lower().encode()
        assert line in head.lower(), head
