"""What another site's page makes a browser send changes nothing here (issue 38).

A browser sends what any page it shows asks for, with whatever credentials
it holds for gpulane (a cached Basic password) or none (no `apiKeys`). So,
before routing and before the key check, for HTTP and websockets alike:

- **Host** (DNS rebinding: a page under the attacker's name that resolves to
  this machine is "same-origin" to the browser). A `Host` must be localhost
  or a `*.localhost` name, an IP address (no DNS answer can point an address
  elsewhere), a name without a dot (an intranet name: no internet site is
  served under one), the name gpulane listens on, this machine's own host
  name, or a name in `server.allowedHosts`; else 403 `host_not_allowed`. Ports are not
  compared: the attacker's page uses this server's port anyway, and a TLS
  proxy in front sends the name alone. `/health` is exempt (a load balancer
  may probe by any name). An app built without a listen address (by a test
  or an embedding, not `gpulane serve`) has no Host check.
- **Cross-site** (`changes_state`: every method but GET/HEAD/OPTIONS; GET
  `/unload`; the model-dispatched GET routes and `/upstream/...`, which queue
  a request and may load a model; every websocket upgrade, which opens an
  upstream's socket). A request whose `Sec-Fetch-Site` is `cross-site` or
  `same-site` (another origin of the same site, such as another port), or
  whose `Origin` is present and not this server's own (its host and port are
  the request's `Host`), gets 403 `cross_site_request`, unless its `Origin` is
  in `server.allowedOrigins`. `Sec-Fetch-Site: same-origin` or `none` (the
  user typed the address) passes whatever the `Origin`: no page can set it,
  and a proxy in front may rewrite `Host`; `Origin` is compared only when a
  browser sends no `Sec-Fetch-Site`. A request with neither header (curl, the
  OpenAI clients, a peer gpulane) is not a browser's and passes.

This is the rule of Go's `net/http.CrossOriginProtection`, plus the Host check
of Vite's `server.allowedHosts`. CORS preflights (app/web/cors.py) are still
answered as llama-swap answers them: a preflight changes nothing, and the
request it announces is judged here when it comes.
"""

from __future__ import annotations

import re
import socket
from typing import Final

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Receive, Scope, Send

from app.config import Config
from app.config.sites import (
    ANY,
    default_port,
    host_name,
    is_ip_literal,
    origin_key,
    origin_text,
    split_host,
)
from app.web.errors import send_error, send_websocket_error
from app.web.model_routes import GET_ROUTES

SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
STATE_CHANGING_GETS: Final = ("/unload", *GET_ROUTES)
"""GET routes that change state: llama-swap's `/unload`, and the model-dispatched
GET routes (app/web/model_routes.py), which queue a request and may load a model."""
UPSTREAM_PREFIX: Final = "/upstream/"
"""`/upstream/MODEL/...`, any method: it may load the model and reaches its server."""
HOST_EXEMPT: Final = frozenset({"/health"})
CROSS_SITE: Final = "cross_site_request"
HOST_NOT_ALLOWED: Final = "host_not_allowed"
_SLASHES: Final = re.compile(r"/{2,}")


def changes_state(kind: str, method: str, path: str) -> bool:
    """Whether a request of this kind, method and path may change state here."""
    if kind == ScopeType.WEBSOCKET:
        return True
    if method not in SAFE_METHODS:
        return True
    if method == "OPTIONS":
        return False  # a CORS preflight: answered before routing (app/web/cors.py)
    # As routing reads it: `/unload/` and `//unload` reach /unload.
    path = _SLASHES.sub("/", path)
    return path.rstrip("/") in STATE_CHANGING_GETS or path.startswith(UPSTREAM_PREFIX)


def own_names(listen_host: str | None) -> frozenset[str]:
    """The names a `Host` may carry without configuration besides localhost and
    addresses: the listen name (if it is one), and this machine's host name
    (also as `NAME.local`, mDNS)."""
    names: set[str] = set()
    if listen_host and not is_ip_literal(host_name(listen_host)):
        names.add(host_name(listen_host))
    machine = socket.gethostname().lower().rstrip(".")
    if machine:
        short = machine.split(".")[0]
        names.update({machine, short, f"{short}.local"})
    return frozenset(names)


def name_allowed(name: str, own: frozenset[str], configured: tuple[str, ...]) -> bool:
    if ANY in configured or is_ip_literal(name) or name in own:
        return True
    if "." not in name:
        # An intranet name (`gpubox`, `x`): no site on the internet is served
        # under one, so none can rebind it; the attack needs a public name.
        return True
    if name == "localhost" or name.endswith(".localhost"):
        return True
    return any(
        name == entry or (entry.startswith(".") and (name == entry[1:] or name.endswith(entry)))
        for entry in configured
    )


def is_own_origin(origin: str, host: str | None) -> bool:
    """Whether `origin` is this server's, as the request reached it: its host
    and port are the `Host` header's (the scheme is not compared: behind a TLS
    proxy the page is https:// and the request reaching gpulane plain)."""
    key = origin_key(origin)
    if key is None or host is None:
        return False
    name, port = split_host(host)
    return key[1] == name and key[2] == (port or default_port(key[0]))


def origin_listed(origin: str, allowed: tuple[str, ...]) -> bool:
    if ANY in allowed:
        return True
    key = origin_key(origin)
    return key is not None and origin_text(key) in allowed


class SiteRules:
    """The two checks, read per request from `config` (a reload may change the
    lists); None: no config (`gpulane ui`), so no list."""

    def __init__(self, config: Config | None, listen_host: str | None) -> None:
        self.config = config
        self.checks_host = listen_host is not None
        self.own = own_names(listen_host) if listen_host is not None else frozenset()

    def allowed_hosts(self) -> tuple[str, ...]:
        return () if self.config is None else self.config.allowed_hosts

    def host_refusal(self, path: str, host: str | None) -> str | None:
        if not self.checks_host or host is None or path in HOST_EXEMPT:
            return None
        name = host_name(host)
        listed = self.allowed_hosts()
        if name_allowed(name, self.own, listed):
            return None
        own = ", ".join(sorted(self.own))
        return (
            f"Host {host!r} is not a name this server answers to: a page under another name "
            "that resolves to this machine (DNS rebinding) could use it through a browser. "
            "Allowed: localhost and *.localhost, IP addresses, names without a dot, "
            f"{own + ', ' if own else ''}and the names in "
            f"server.allowedHosts ({', '.join(listed) or 'none set'}); "
            "add this name there to reach gpulane by it"
        )

    def cross_site_refusal(self, headers: dict[str, str]) -> str | None:
        origin = headers.get("origin")
        site = headers.get("sec-fetch-site", "").strip().lower()
        allowed = () if self.config is None else self.config.allowed_origins
        if ANY in allowed or (origin is not None and origin_listed(origin, allowed)):
            return None
        if site in ("same-origin", "none"):
            # The browser's own word, which no page can set: trusted as Go does,
            # so a proxy in front that rewrites `Host` keeps the console working.
            return None
        if site in ("cross-site", "same-site"):
            sent = f"Sec-Fetch-Site: {site}" + (f", Origin {origin}" if origin else "")
        elif origin is not None and not is_own_origin(origin, headers.get("host")):
            sent = f"Origin {origin}, not this server's own ({headers.get('host', 'no Host')})"
        else:
            return None
        return (
            f"refused: a page of another site sent this through a browser ({sent}), and a "
            "browser sends what any page asks, with the credentials it holds; requests that "
            "change state or reach an upstream come from gpulane's own pages or from clients "
            "that are not browsers. To let that site's pages call gpulane, add its origin to "
            "server.allowedOrigins"
        )


def guard_sites(app: ASGIApp, rules: SiteRules) -> ASGIApp:
    """Wrap the whole ASGI app (outside the CORS preflights and the key check)."""

    async def guard(scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in (ScopeType.HTTP, ScopeType.WEBSOCKET):
            await app(scope, receive, send)
            return
        headers: dict[str, str] = {}
        for k, v in scope["headers"]:  # the first of each, as Go's Header.Get
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        path = scope["path"]
        method = str(scope.get("method", "GET"))  # a websocket has none: it opens with a GET
        refusal, code = rules.host_refusal(path, headers.get("host")), HOST_NOT_ALLOWED
        if refusal is None and changes_state(kind, method, path):
            reason = rules.cross_site_refusal(headers)
            refusal, code = (
                (None, code) if reason is None else (f"{method} {path} {reason}", CROSS_SITE)
            )
        if refusal is None:
            await app(scope, receive, send)
            return
        if kind == ScopeType.WEBSOCKET:
            # Refused before accept: HTTP 403 where the server can answer one.
            if (await receive())["type"] == "websocket.connect":
                await send_websocket_error(scope, send, 403, refusal, code=code)
            return
        # Readable by the page that sent it, so its author learns why.
        await send_error(
            send, 403, refusal, code=code, headers=[(b"access-control-allow-origin", b"*")]
        )

    return guard
