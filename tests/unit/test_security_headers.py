"""The security headers hook (app/web/console/security.py): on every answer,
once, except a model server's own HTML page under /upstream/."""

from __future__ import annotations

from typing import Any

from app.web.console.security import SECURITY_HEADERS, add_security_headers


async def sent(path: str, headers: list[tuple[bytes, bytes]]) -> dict[bytes, list[bytes]]:
    message: Any = {"type": "http.response.start", "status": 200, "headers": headers}
    scope: Any = {"type": "http", "path": path, "raw_path": path.encode()}
    await add_security_headers(message, scope)
    out: dict[bytes, list[bytes]] = {}
    for name, value in message["headers"]:
        out.setdefault(name.lower(), []).append(value)
    return out


async def test_every_answer_gets_each_header_once() -> None:
    json_type = [(b"content-type", b"application/json")]
    for path in ("/v1/chat/completions", "/nowhere", "/upstream/A/slots"):
        got = await sent(path, json_type)
        for header in SECURITY_HEADERS:
            assert got[header.name.lower().encode()] == [str(header.value).encode()]
    # A route that set one itself keeps its own, not two.
    got = await sent("/ui/", [(b"X-Frame-Options", b"SAMEORIGIN")])
    assert got[b"x-frame-options"] == [b"SAMEORIGIN"]


async def test_a_model_servers_own_page_keeps_its_policy() -> None:
    page = [(b"content-type", b"text/html; charset=utf-8")]
    assert b"content-security-policy" not in await sent("/upstream/A/", page)
    assert b"content-security-policy" in await sent("/ui/", page)


async def test_body_messages_are_left_alone() -> None:
    message: Any = {"type": "http.response.body", "body": b"x"}
    scope: Any = {"type": "http", "path": "/"}
    await add_security_headers(message, scope)
    assert message == {"type": "http.response.body", "body": b"x"}
