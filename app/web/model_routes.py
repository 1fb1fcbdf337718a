"""The routes llama-swap dispatches by model, how their paths reach the
upstream, and model ids in URL paths.

The tables are llama-swap's (its `internal/server/server.go` at the head read
for issue 24): a JSON body's `model`, a multipart form's `model` field, or, on
the GET routes, the `model` query parameter names the model. Each route goes
through the same proxy path (queue, score, log) as any inference request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import unquote

from litestar import asgi
from litestar.handlers import BaseRouteHandler
from litestar.types import Receive, Scope, Send

from app.web.errors import send_error

JSON_ROUTES = (
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/reranking",
    "/rerank",
    "/v1/rerank",
    "/v1/reranking",
    "/infill",
    "/completion",
    "/v1/audio/speech",
    "/v1/audio/voices",
    "/v1/images/generations",
    "/sdapi/v1/txt2img",
    "/sdapi/v1/img2img",
    # audio.cpp's task API: reaches the upstream as /v1/tasks/run.
    "/audioapi/v1/tasks/run",
    # Versionless: reach the upstream without the /v (llama-swap issue #728).
    "/v/chat/completions",
    "/v/responses",
    "/v/completions",
    "/v/messages",
    "/v/messages/count_tokens",
    "/v/embeddings",
    "/v/rerank",
    "/v/reranking",
)
"""POST, the model in the JSON body."""

FORM_ROUTES = ("/v1/audio/transcriptions", "/v1/images/edits")
"""POST, the model in a multipart/form-data field."""

GET_ROUTES = ("/v1/audio/voices", "/sdapi/v1/loras", "/props")
"""GET, the model in the query string (`?model=...`)."""


def forwarded_path(path: str) -> str:
    """The path a model-dispatched request reaches its upstream at: `/v/...`
    loses its `/v`, `/audioapi/...` its `/audioapi`; any other path (`/sdapi`
    included) is sent as it is."""
    if path.startswith("/v/"):
        return path[len("/v") :]
    if path.startswith("/audioapi/"):
        return path[len("/audioapi") :]
    return path


def model_in_path(names: Mapping[str, str], raw: str) -> tuple[str, str, str] | None:
    """The longest leading run of segments of `raw` (a %-encoded path, without
    its leading slash) that names a configured model or alias, so an id with a
    slash (`org/model`) works whether the client sent its slash as `/` or `%2F`.
    Returns (the name as requested, the model id, the rest of the path still
    %-encoded, with a leading slash), or None."""
    segments = raw.split("/")
    for end in range(len(segments), 0, -1):
        name = unquote("/".join(segments[:end]))
        model = names.get(name)
        if name and model is not None:
            return name, model, "/" + "/".join(segments[end:])
    return None


Source = str  # "json" | "form" | "query": where the model is read from


Upgrade = Callable[[Scope, Receive, Send], Awaitable[None]]
"""Serves a websocket upgrade on a GET route (app/web/websocket_proxy.py)."""


def model_route_handlers(
    handle: Callable[[Scope, Receive, Send, Source], Awaitable[None]],
    upgrade: Upgrade | None = None,
) -> list[BaseRouteHandler]:
    """Raw ASGI handlers for every model-dispatched route; `handle` serves a
    request once its method is known to fit the route, `upgrade` a websocket
    on a GET route (llama-swap's reverse proxy passes those through; a socket
    always opens with a GET, so the POST routes refuse one)."""
    sources: dict[str, dict[str, Source]] = {}
    for path in JSON_ROUTES:
        sources.setdefault(path, {})["POST"] = "json"
    for path in FORM_ROUTES:
        sources.setdefault(path, {})["POST"] = "form"
    for path in GET_ROUTES:
        sources.setdefault(path, {})["GET"] = "query"
    # One handler per method table, each on every path that shares it.
    grouped: dict[tuple[tuple[str, Source], ...], list[str]] = {}
    for path, by_method in sources.items():
        grouped.setdefault(tuple(sorted(by_method.items())), []).append(path)
    return [
        asgi(path=paths, is_mount=False, copy_scope=False)(_by_method(dict(table), handle, upgrade))
        for table, paths in grouped.items()
    ]


def _by_method(
    table: dict[str, Source],
    handle: Callable[[Scope, Receive, Send, Source], Awaitable[None]],
    upgrade: Upgrade | None,
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    allowed = ", ".join(sorted(table))

    async def by_method(scope: Any, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            if upgrade is not None and table.get("GET") == "query":
                await upgrade(scope, receive, send)
            else:
                await send({"type": "websocket.close", "code": 1008, "reason": "not a GET route"})
            return
        source = table.get(scope["method"])
        if source is None:
            await send_error(
                send,
                405,
                f"method {scope['method']} is not allowed on {scope['path']}; allowed: {allowed}",
                code="method_not_allowed",
                headers=[(b"allow", allowed.encode())],
            )
            return
        await handle(scope, receive, send, source)

    return by_method
