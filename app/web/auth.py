"""llama-swap's `apiKeys`: a Bearer token, a Basic-auth password or `x-api-key`."""

from __future__ import annotations

import base64
import hmac
from collections.abc import Callable

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Receive, Scope, Send

from app.web.errors import send_error

OPEN_PATHS = frozenset({"/health"})


def presented_key(headers: dict[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value:
        return value.strip()
    if scheme.lower() == "basic" and value:
        try:
            decoded = base64.b64decode(value.strip()).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2] or None
    return headers.get("x-api-key") or None


def caller_label(keys: tuple[str, ...], key: str) -> str | None:
    """`key#N` for the Nth configured key: identifies a caller without storing the key."""
    for i, candidate in enumerate(keys):
        if hmac.compare_digest(candidate.encode(), key.encode()):
            return f"key#{i + 1}"
    return None


def api_key_middleware(keys: tuple[str, ...]) -> Callable[[ASGIApp], ASGIApp]:
    def factory(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != ScopeType.HTTP or scope["path"] in OPEN_PATHS:
                await app(scope, receive, send)
                return
            headers = {
                k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
            }
            key = presented_key(headers)
            label = caller_label(keys, key) if key else None
            if label is None:
                await send_error(
                    send,
                    401,
                    "missing or invalid API key: send it as 'Authorization: Bearer KEY', "
                    "as the Basic-auth password, or as 'x-api-key'",
                    code="invalid_api_key",
                    headers=[
                        (b"www-authenticate", b'Bearer realm="gpulane", Basic realm="gpulane"')
                    ],
                )
                return
            scope.setdefault("state", {})["caller"] = label
            await app(scope, receive, send)

        return middleware

    return factory
