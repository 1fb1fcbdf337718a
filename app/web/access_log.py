"""`logRequests: true`: one access line per HTTP request, at info, as llama-swap
prints it (its proxy manager's request logger), plus what gpulane knows:

    Request 127.0.0.1 "POST /v1/chat/completions HTTP/1.1" 200 512 "curl/8.5.0" 1.234s
        model=smollm2 id=4f0c...      (one line)

client, request line, status, body bytes sent, user agent, duration (to the last
byte sent), the model the request named (when a route read one) and the request
id (`X-Request-Id`, when the answer carries one); `-` for what is not known. A
websocket's line is its upgrade (`GET`, 101 once accepted, the bytes of the
messages sent to the client), written when it closes.

It wraps the whole ASGI app, outside routing, so every route is logged however it
is mounted (Litestar's handlers, raw ASGI apps beside them). Whether it logs is
read per request, so a reload (SIGHUP, -watch-config) turns it on or off; off, a
request costs one call and nothing is added to its scope.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any, cast

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("gpulane.access")

_NOTE = "gpulane.access"
"""The scope key of a request's `_Note` while access lines are on."""


class _Note:
    """What routes learn about the request that the access line names."""

    __slots__ = ("model",)

    def __init__(self) -> None:
        self.model: str | None = None


def note_model(scope: Scope | dict[str, Any], model: str | None) -> None:
    """A route read the model the request names: its access line shows it."""
    note = scope.get(_NOTE)
    if isinstance(note, _Note) and model:
        note.model = model


def access_log(app: ASGIApp, enabled: Callable[[], bool]) -> ASGIApp:
    """Wrap the whole ASGI app; `enabled` is asked once per request."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in (ScopeType.HTTP, ScopeType.WEBSOCKET) or not enabled():
            await app(scope, receive, send)
            return
        start = time.perf_counter()
        # Captured first: a mounted app may rewrite the scope's path. A websocket
        # is its upgrade, a GET; its line comes when it closes.
        method = scope["method"] if scope["type"] == ScopeType.HTTP else "GET"
        path = scope["path"]
        note = _Note()
        scope[_NOTE] = note  # type: ignore[literal-required]
        status: int | None = None
        sent = 0
        request_id: str | None = None
        done = False

        def line() -> None:
            nonlocal done
            done = True
            log.info(
                'Request %s "%s %s HTTP/%s" %s %d "%s" %.3fs model=%s id=%s',
                (scope.get("client") or ("-",))[0],
                _clean(method),
                _clean(path),
                scope.get("http_version", "1.1"),
                "-" if status is None else status,
                sent,
                _clean(_header(scope.get("headers", ()), b"user-agent") or "-"),
                time.perf_counter() - start,
                _clean(note.model or "-"),
                _clean(request_id or "-"),
            )

        async def watch(message: Message) -> None:
            nonlocal status, sent, request_id
            m = cast(dict[str, Any], message)  # one union of a dozen shapes
            kind = m["type"]
            if kind in ("http.response.start", "websocket.http.response.start"):
                status = m["status"]
                request_id = _header(m.get("headers", ()), b"x-request-id")
            elif kind == "websocket.accept":
                status = 101
                request_id = _header(m.get("headers", ()), b"x-request-id")
            elif kind == "websocket.close" and status is None:
                status = 403  # closed before it was accepted (ASGI's rule)
            elif kind in ("http.response.body", "websocket.http.response.body"):
                sent += len(m.get("body", b""))
            elif kind == "websocket.send":
                sent += len(m.get("bytes") or (m.get("text") or "").encode())
            await send(message)
            # At the last byte: what the app does after it is not the client's time.
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                line()

        try:
            await app(scope, receive, watch)
        finally:
            if not done:  # a websocket closed; or the client left, or the app failed
                line()

    return wrapped


def _clean(text: str) -> str:
    """Quotes, backslashes and control characters escaped: what a client sends
    cannot forge or break a log line."""
    return json.dumps(text)[1:-1]


def _header(headers: Any, name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None
