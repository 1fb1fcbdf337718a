"""The Litestar application: OpenAI routes (raw ASGI, see proxy.py) and admin routes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote

from litestar import Litestar, MediaType, Request, Response, asgi, get, post
from litestar.datastructures import State
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath, FromQuery
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import Engine

from app.config import Config
from app.runtime.log_buffer import LogBuffer
from app.runtime.scheduler import Scheduler
from app.web.access import ACCESS_HANDLERS, admin_only, identity, only_caller
from app.web.access_log import note_model
from app.web.auth import api_key_middleware
from app.web.console import Live, console_routes, open_console_assets
from app.web.console.security import add_security_headers
from app.web.cors import answer_preflights
from app.web.errors import EXCEPTION_HANDLERS, error_response, send_error
from app.web.events_api import events_routes
from app.web.llama_swap_routes import listing_routes, log_routes
from app.web.model_routes import model_in_path, model_route_handlers
from app.web.proxy import Proxy
from app.web.sites import SiteRules, guard_sites
from app.web.stream_headers import no_proxy_buffering
from app.web.websocket_proxy import Upgrades, WebsocketProxy

_UPSTREAM_PREFIX = "/upstream"


def create_app(
    config: Config,
    scheduler: Scheduler,
    proxy: Proxy,
    logs: LogBuffer,
    *,
    activity: Callable[[int, int, str | None], list[dict[str, Any]]] | None = None,
    engine: Engine | None = None,
    extra_handlers: Sequence[BaseRouteHandler] = (),
    on_startup: Sequence[Callable[[], Any]] = (),
    on_shutdown: Sequence[Callable[[], Any]] = (),
    listen_host: str | None = None,
) -> Litestar:
    """`listen_host`: the address `gpulane serve` listens on, for the Host check
    (app/web/sites.py); None (a test's or an embedding's app): no Host check."""
    sockets = Upgrades(WebsocketProxy(config, scheduler))
    handlers: list[BaseRouteHandler] = [
        # Every route llama-swap dispatches by model (app/web/model_routes.py).
        *model_route_handlers(proxy.inference, sockets.on_model_route),
        # An upstream's own pages (/slots, /metrics) show every caller's work: admin only.
        asgi(path="/upstream", is_mount=True, copy_scope=False, guards=[admin_only])(
            _upstream_mount(proxy, sockets)
        ),
    ]

    @get("/health", media_type=MediaType.TEXT, sync_to_thread=False)
    def health() -> Response[str]:
        # Not OK while the log refuses writes: nothing new is admitted then.
        refusal = scheduler.log_refusal()
        if refusal is None:
            return Response("OK")
        return Response(
            f"event log cannot be written: {refusal[0]}; admitting nothing new until it can",
            status_code=503,
            headers={"Retry-After": str(refusal[1])},
        )

    # Each answers once the processes have stopped (Scheduler.unload).
    @get("/unload", media_type=MediaType.TEXT, guards=[admin_only])
    async def unload_all_get() -> str:
        await scheduler.unload(None)
        return "OK"

    # llama-swap's bodies (its internal/server/apigroup.go): JSON `{"msg":"ok"}`
    # for every model, plain `OK` for one.
    @post("/api/models/unload", status_code=200, guards=[admin_only])
    async def unload_all() -> Response[bytes]:
        await scheduler.unload(None)
        return Response(b'{"msg":"ok"}\n', media_type=MediaType.JSON)

    # {model:path}: an id may hold slashes (org/model), sent as / or %2F.
    @post(
        "/api/models/unload/{model:path}",
        status_code=200,
        guards=[admin_only],
    )
    async def unload_one(model: FromPath[str]) -> Response[Any]:
        model = model.lstrip("/")
        resolved = config.resolve_model(model)
        if resolved is None or config.models[resolved].peer is not None:
            what = "is not configured" if resolved is None else "is a peer's: nothing runs here"
            return error_response(404, f"model {model!r} {what}", "model_not_found")
        await scheduler.unload(resolved)
        return Response("OK", media_type=MediaType.TEXT)

    # Every caller's labels and counts: a scraper uses an admin key.
    @get("/metrics", sync_to_thread=False, guards=[admin_only])
    def metrics() -> Response[bytes]:
        return Response(
            generate_latest(scheduler.metrics_registry()), media_type=CONTENT_TYPE_LATEST
        )

    @get("/logs", media_type=MediaType.TEXT, sync_to_thread=False, guards=[admin_only])
    def logs_text() -> str:
        return logs.text()

    @get("/api/activity")
    async def activity_page(
        request: Request[Any, Any, Any], limit: FromQuery[int] = 50, offset: FromQuery[int] = 0
    ) -> dict[str, Any]:
        limit = max(1, min(limit, 1000))
        # SQLite's OFFSET is a signed 64-bit integer; past the end is an empty page anyway.
        offset = max(0, min(offset, 2**62))
        rows = []
        if activity is not None:
            # A user key sees only its own requests.
            caller = only_caller(identity(request.scope))
            rows = await asyncio.to_thread(activity, limit, offset, caller)
        return {"data": rows, "limit": limit, "offset": offset}

    handlers += [
        health,
        unload_all_get,
        unload_all,
        unload_one,
        metrics,
        logs_text,
        activity_page,
    ]
    # /v1/models, /models, /running and the log streams, in llama-swap's shapes.
    handlers += listing_routes(config, scheduler) + log_routes(config, logs)
    handlers += events_routes(config, scheduler, logs)  # llama-swap's /api/events
    handlers += list(extra_handlers)
    # The web console (/ui/, and / redirects there); its shells and assets need no key.
    handlers += console_routes(engine, Live(config, scheduler, logs))
    app = Litestar(
        route_handlers=handlers,
        on_startup=list(on_startup),
        on_shutdown=list(on_shutdown),
        state=State({"scheduler": scheduler}),
        request_max_body_size=None,
        exception_handlers={**EXCEPTION_HANDLERS, **ACCESS_HANDLERS},
        # Every answer, errors and redirects too.
        before_send=[add_security_headers, no_proxy_buffering],
        logging_config=None,  # serve.py configures logging once, for every module
        debug=False,
    )
    # Before routing, which rewrites a mounted app's path (app/web/auth.py);
    # read per request: a reload may add, change or remove apiKeys.
    keyed = open_console_assets(api_key_middleware(lambda: config.api_keys))
    app.asgi_handler = keyed(app.asgi_handler)
    # Outside routing and the key check: every OPTIONS is a CORS preflight (app/web/cors.py).
    app.asgi_handler = answer_preflights(app.asgi_handler)
    # Outermost: the Host and what another site's page sent (app/web/sites.py).
    app.asgi_handler = guard_sites(app.asgi_handler, SiteRules(config, listen_host))
    return app


def _post_only(handle: Callable[..., Any]) -> Callable[..., Any]:
    """A raw ASGI route takes every method; the inference routes take only POST."""

    async def post_only(scope: Any, receive: Any, send: Any) -> None:
        if scope["method"] != "POST":
            await send_error(
                send,
                405,
                f"method {scope['method']} is not allowed on {scope['path']}; allowed: POST",
                code="method_not_allowed",
                headers=[(b"allow", b"POST")],
            )
            return
        await handle(scope, receive, send)

    return post_only


def _upstream_mount(proxy: Proxy, sockets: Upgrades) -> Callable[..., Any]:
    async def upstream(scope: Any, receive: Any, send: Any) -> None:
        # Litestar cannot mount under a path parameter (/upstream/{model} never
        # matches a longer path) and adds a trailing slash to a mount's
        # scope["path"], which would defeat ignorePaths' `$`; so split the raw
        # path: /upstream/MODEL/REST -> model MODEL, path /REST (still %-encoded,
        # as the client sent it).
        raw = scope.get("raw_path") or scope["path"].encode("utf-8")
        raw_path = raw.decode("latin-1").split("?", 1)[0]
        if scope["type"] == "websocket":
            await sockets.on_upstream(scope, receive, send, raw_path)
            return
        if raw_path == _UPSTREAM_PREFIX and scope["method"] in ("GET", "HEAD"):
            # llama-swap's list of models with their pages is its UI's models page.
            await _redirect(send, 302, "/ui/models")
            return
        if raw_path == _UPSTREAM_PREFIX:
            message = f"method {scope['method']} is not allowed on /upstream; allowed: GET, HEAD"
            allow = [(b"allow", b"GET, HEAD")]
            await send_error(send, 405, message, code="method_not_allowed", headers=allow)
            return
        rest = raw_path[len(_UPSTREAM_PREFIX) :].lstrip("/")
        # The longest configured id or alias the path starts with: an id may hold
        # slashes (org/model), sent as / or %2F.
        found = model_in_path(proxy.config.name_index, rest)
        if found is not None:
            model, _, path = found
            if path == "/" and not rest.endswith("/"):
                # /upstream/MODEL -> /upstream/MODEL/, so the server's relative
                # links resolve: 301, or 308 to keep a method other than GET/HEAD.
                status = 301 if scope["method"] in ("GET", "HEAD") else 308
                query = bytes(scope.get("query_string", b"")).decode("latin-1")
                await _redirect(send, status, raw_path + "/" + (f"?{query}" if query else ""))
                return
        else:
            first, _, tail = rest.partition("/")
            model, path = unquote(first), "/" + tail
        if not model:
            await send_error(
                send, 404, "use /upstream/MODEL/PATH to reach a model's server", code="not_found"
            )
            return
        scope["path_params"] = {"model": model, "path": path}
        note_model(scope, model)
        await proxy.upstream(scope, receive, send)

    return upstream


async def _redirect(send: Any, status: int, location: str) -> None:
    headers = [(b"location", location.encode("latin-1")), (b"content-length", b"0")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


__all__ = ["create_app", "Request"]
