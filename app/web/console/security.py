"""What the console's responses promise the browser, and which console paths need no key.

The content security policy allows only gpulane's own origin: every script,
style and image is served from app/web/console/static/, nothing is inline, so
an injected string in a model name or caller label can never run.

The page shells and static files hold no data (everything comes from the
`/ui/api/` and `/api/` routes, which do need a key), so they are served
without one: that is how a browser with `apiKeys` configured gets the page
that asks for the key.
"""

from __future__ import annotations

from collections.abc import Callable

from litestar.datastructures import ResponseHeader
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from app.web.auth import routed_path

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)

SECURITY_HEADERS = [
    ResponseHeader(name="Content-Security-Policy", value=CONTENT_SECURITY_POLICY),
    ResponseHeader(name="X-Content-Type-Options", value="nosniff"),
    ResponseHeader(name="X-Frame-Options", value="DENY"),
    ResponseHeader(name="Referrer-Policy", value="no-referrer"),
    ResponseHeader(name="Cross-Origin-Opener-Policy", value="same-origin"),
    ResponseHeader(name="Cross-Origin-Resource-Policy", value="same-origin"),
]

_RAW_HEADERS = [(h.name.lower().encode(), str(h.value).encode()) for h in SECURITY_HEADERS]
"""SECURITY_HEADERS as (name, value) bytes, for the raw ASGI message and the socket."""


def security_header_lines() -> bytes:
    """SECURITY_HEADERS as HTTP/1.1 header lines, for an answer written straight
    to the socket (app/web/limits.py)."""
    return b"".join(name + b": " + value + b"\r\n" for name, value in _RAW_HEADERS)


async def add_security_headers(message: Message, scope: Scope) -> None:
    """Litestar `before_send` hook: every response gpulane sends carries
    SECURITY_HEADERS (those it does not set already), errors, redirects and
    proxied answers included, so none of them is a page that runs scripts or is
    framed. One exception: a model server's own HTML page under `/upstream/`
    (llama-server's web UI runs its own inline scripts) keeps its own policy."""
    if message["type"] != "http.response.start":
        return
    headers = list(message.get("headers") or [])
    present = {bytes(name).lower() for name, _ in headers}
    path = bytes(scope.get("raw_path") or str(scope.get("path", "")).encode())
    if path.startswith(b"/upstream/") and any(
        bytes(name).lower() == b"content-type" and bytes(value).lower().startswith(b"text/html")
        for name, value in headers
    ):
        return
    headers += [(name, value) for name, value in _RAW_HEADERS if name not in present]
    message["headers"] = headers


PAGES = ("/ui/", "/ui/timeline", "/ui/models", "/ui/batches", "/ui/chains", "/ui/history")
"""Page paths (plus /ui/requests/ID, /ui/batches/ID and /ui/chains/ID): each serves
the same shell, which draws the page."""


def is_open_console_path(path: str) -> bool:
    """A path with no data behind it: `/`, the shells and the static assets."""
    if path in ("/", "/ui") or path in PAGES or path.startswith("/ui/static/"):
        return True
    for page in ("/ui/requests/", "/ui/batches/", "/ui/chains/"):
        rest = path.removeprefix(page)
        if rest != path and "/" not in rest:
            return True
    return False


def open_console_assets(
    guard: Callable[[ASGIApp], ASGIApp],
) -> Callable[[ASGIApp], ASGIApp]:
    """Wrap a key-checking middleware so the console's shells and assets skip it."""

    def factory(app: ASGIApp) -> ASGIApp:
        guarded = guard(app)

        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == ScopeType.HTTP and is_open_console_path(routed_path(scope)):
                await app(scope, receive, send)
            else:
                await guarded(scope, receive, send)

        return middleware

    return factory
