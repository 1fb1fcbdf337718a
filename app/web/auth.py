"""Who is calling: llama-swap's `apiKeys` (a Bearer token, a Basic-auth password
or `x-api-key`), or, without keys, the optional `X-Gpulane-Caller` header.

A request's caller is its key's label, never the key. The middleware puts an
`Identity` (label, role, priority policy; no secret) in the ASGI scope's state
for the routes to read with `identify`.
"""

from __future__ import annotations

import base64
import hmac
from collections.abc import Callable
from typing import Literal

import msgspec
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Receive, Scope, Send
from litestar.utils.path import normalize_path

from app.config.callers import CALLER_LABEL_RULE, is_caller_label
from app.config.resolved import ApiKey
from app.core.priority import grant
from app.web.errors import send_error, send_websocket_error
from app.web.request_body import BadRequest

OPEN_PATHS = frozenset({"/health"})
CALLER_HEADER = "X-Gpulane-Caller"
_NO_KEY = (
    "missing or invalid API key: send it as 'Authorization: Bearer KEY', "
    "as the Basic-auth password, or as 'x-api-key'"
)


class Identity(msgspec.Struct, frozen=True, kw_only=True):
    """A request's caller and what its key allows; None caller = anonymous."""

    caller: str | None = None
    role: Literal["admin", "user"] = "admin"
    """Without apiKeys everyone may do everything, as in llama-swap."""
    max_priority: int | None = None
    default_priority: int = 0

    def grant(self, requested: int | None) -> int:
        return grant(requested, self.max_priority, self.default_priority)


ANONYMOUS = Identity()


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


def find_key(keys: tuple[ApiKey, ...], presented: str) -> ApiKey | None:
    """The configured key `presented` is, compared in constant time per key."""
    for candidate in keys:
        if hmac.compare_digest(candidate.key.encode(), presented.encode()):
            return candidate
    return None


def identity_of(key: ApiKey) -> Identity:
    return Identity(
        caller=key.label,
        role=key.role,
        max_priority=key.max_priority,
        default_priority=key.default_priority,
    )


def identify(scope: Scope, headers: dict[str, str]) -> Identity:
    """The caller of a request: what the key middleware found, else the
    `X-Gpulane-Caller` header (BadRequest if it is not a caller label), else
    anonymous. With apiKeys the header is ignored: the key names the caller."""
    found = scope.get("state", {}).get("identity")
    if isinstance(found, Identity):
        return found
    named = headers.get(CALLER_HEADER.lower())
    if named is None:
        return ANONYMOUS
    label = named.strip(" \t")
    if not is_caller_label(label):
        shown = label if len(label) <= 64 else label[:61] + "..."
        raise BadRequest(
            400,
            f"header {CALLER_HEADER} {shown!r} is not a caller label; expected {CALLER_LABEL_RULE}",
            "invalid_caller",
        )
    return Identity(caller=label)


def routed_path(scope: Scope) -> str:
    """The path routing will match (`/health/` and `//health` are `/health`),
    from the path the client sent: a check wrapped around the application, as
    the key check must be. Inside it, routing has rewritten a mounted app's
    path to what follows the mount (`/comfyui` is `/` there, `/comfyui/ui` is
    `/ui/`), which would pass for the console's open pages."""
    return normalize_path(str(scope["path"]))


def api_key_middleware(keys: Callable[[], tuple[ApiKey, ...]]) -> Callable[[ASGIApp], ASGIApp]:
    """`keys()`: the configured apiKeys as of this request (a reload may change
    them); none configured: every request passes, as before any key. Wraps the
    whole application, before routing (see `routed_path`)."""

    def factory(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            kind = scope["type"]
            configured = keys()
            if (
                not configured
                or kind not in (ScopeType.HTTP, ScopeType.WEBSOCKET)
                or routed_path(scope) in OPEN_PATHS
            ):
                await app(scope, receive, send)
                return
            headers = {
                k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
            }
            presented = presented_key(headers)
            key = find_key(configured, presented) if presented else None
            if key is None:
                challenge = [
                    (b"www-authenticate", b'Bearer realm="gpulane", Basic realm="gpulane"')
                ]
                if kind == ScopeType.WEBSOCKET:
                    # Refused before accept: HTTP 401 where the server can answer one.
                    if (await receive())["type"] == "websocket.connect":
                        await send_websocket_error(
                            scope, send, 401, _NO_KEY, code="invalid_api_key", headers=challenge
                        )
                    return
                await send_error(send, 401, _NO_KEY, code="invalid_api_key", headers=challenge)
                return
            scope.setdefault("state", {})["identity"] = identity_of(key)
            await app(scope, receive, send)

        return middleware

    return factory
