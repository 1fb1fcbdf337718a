"""CORS as llama-swap's middleware does it (its `internal/server/auth.go`,
`CreateCORSMiddleware`): every `OPTIONS` request, on any path, is a preflight
answered 204 before routing and before the API-key check, so a browser app on
another origin can call gpulane with `apiKeys` set. Other requests pass through
untouched; `/v1/models` echoes the `Origin` itself (app/web/llama_swap_routes.py),
and proxied answers carry whatever CORS headers the model's server sends.

A preflight changes nothing, so it stays this permissive: the request it
announces is judged when it comes (app/web/sites.py), where a route that
changes state refuses another site's page unless `server.allowedOrigins`
lists it.
"""

from __future__ import annotations

import re

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Receive, Scope, Send

ALLOW_METHODS = b"GET, POST, PUT, PATCH, DELETE, OPTIONS"
DEFAULT_ALLOW_HEADERS = b"Content-Type, Authorization, Accept, X-Requested-With"
MAX_AGE = b"86400"
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def allowed_headers(requested: bytes | None) -> bytes:
    """`Access-Control-Request-Headers` echoed back, less any name that is not
    an HTTP token (it could not be a header); llama-swap's default list when
    the browser asked for none."""
    if not requested:
        return DEFAULT_ALLOW_HEADERS
    names = (part.strip() for part in requested.split(b","))
    return b", ".join(name for name in names if _TOKEN.fullmatch(name))


def preflight_headers(requested: bytes | None) -> list[tuple[bytes, bytes]]:
    return [
        (b"access-control-allow-origin", b"*"),
        (b"access-control-allow-methods", ALLOW_METHODS),
        (b"access-control-allow-headers", allowed_headers(requested)),
        (b"access-control-max-age", MAX_AGE),
    ]


def answer_preflights(app: ASGIApp) -> ASGIApp:
    """Wrap the whole ASGI app (outside routing and the key middleware)."""

    async def cors(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP or scope["method"] != "OPTIONS":
            await app(scope, receive, send)
            return
        # The first field, as Go's Header.Get reads it.
        requested = next(
            (v for k, v in scope["headers"] if k.lower() == b"access-control-request-headers"),
            None,
        )
        await send(
            {"type": "http.response.start", "status": 204, "headers": preflight_headers(requested)}
        )
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return cors
