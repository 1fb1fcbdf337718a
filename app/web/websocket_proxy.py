"""Websocket upgrades passed through to a model's server, where llama-swap
passes them: `/upstream/MODEL/...` (OpenAI Realtime at
`/upstream/MODEL/v1/realtime`, ComfyUI's `/ws`, ...) and the model-dispatched
GET routes (`?model=`). llama-swap's reverse proxy forwards the `Upgrade`;
here uvicorn takes the client's side and the `websockets` package opens the
same socket to the upstream, and messages pass both ways as they come.

A socket is a request like any other: admitted, queued by its score, and
holding a slot of its model from the upstream handshake until either side
closes it (recorded as completed with status 101), or until the scheduler
takes it away (`maxRunTime`, an operator's cancel, shutdown), which closes both
sides. A socket refused before it opens (bad key, unknown model, queue full,
the upstream's own refusal) gets an HTTP answer in gpulane's error shape, or
the upstream's own. The key is checked by the key middleware (app/web/auth.py),
for sockets as for HTTP; an upgrade another site's page asked for (its
`Origin` not this server's nor in `server.allowedOrigins`) is refused before
that (app/web/sites.py): the page could read and write the upstream's socket.

A model with `compat.ignoreWebsockets` is llama-swap's exception, and a
render server (`kind`: ComfyUI, a Videos API server) is another: its socket is
a client's side channel beside its jobs, not a job, and must not take the one
slot its renders hold (docs/renders.md). Their sockets bypass the scheduler:
they are not queued, hold no slot, count toward nothing, and cannot load the
model: one is refused with 409 `model_not_loaded` unless the model is loaded
and ready, and a swap may stop the model under it (the socket then closes),
the trade llama-swap documents for opting out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from typing import Any
from urllib.parse import unquote

from litestar.types import Receive, Scope, Send
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from app.config import Config
from app.core.priority import HEADER, grant, read_priority, unreadable_priority
from app.runtime.admission import Refused
from app.runtime.api import Admission, Detached, Ticket
from app.runtime.scheduler import Scheduler
from app.web.access_log import note_model
from app.web.auth import Identity, identify
from app.web.errors import (
    request_id_header,
    retry_after,
    send_websocket_error,
    send_websocket_refusal,
    start_failure,
)
from app.web.forward import HOP_BY_HOP, outgoing_headers, ticket_headers
from app.web.model_routes import forwarded_path, model_in_path
from app.web.refusals import Asked, record
from app.web.request_body import BadRequest, max_wait_ns, query_model

log = logging.getLogger("gpulane.proxy")

HANDSHAKE_HEADERS = frozenset(
    {
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
        "sec-websocket-protocol",
        "sec-websocket-accept",
    }
)
"""The client's handshake with gpulane; the upstream handshake has its own."""

_UNSENDABLE = {1005, 1006, 1015}
"""Close codes that only report what happened and may not be sent (RFC 6455, 7.4.1)."""


def websocket_url(base: str, path: str, query: str) -> str:
    """The upstream's socket: its `proxy` URL with ws:// or wss://."""
    url = re.sub(r"^http", "ws", base.rstrip("/")) + path
    return url + (f"?{query}" if query else "")


class WebsocketProxy:
    def __init__(self, config: Config, scheduler: Scheduler) -> None:
        self.config = config
        self.scheduler = scheduler

    async def serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        requested: str | None,
        path: str,
        endpoint: str,
        *,
        admin_only: bool = False,
    ) -> None:
        """Serve one upgrade: `requested` names the model (None: none named),
        `path` (still %-encoded) is where it reaches the upstream, `endpoint`
        what the log records."""
        if (await receive())["type"] != "websocket.connect":
            return
        deny = _Denial(scope, send)
        headers = _headers(scope)
        asked = read_priority(headers.get(HEADER.lower()))
        # What is known of the request when it is refused, for its record.
        refused = Asked(endpoint, requested, grant(asked))
        try:
            identity = self._identify(scope, headers, endpoint, admin_only=admin_only)
            refused = refused._replace(priority=identity.grant(asked), caller=identity.caller)
            max_wait = max_wait_ns(headers)
        except BadRequest as exc:
            if exc.status in (401, 403):  # its key's: answered, as before a door, unrecorded
                challenge = [(b"www-authenticate", b'Bearer realm="gpulane"')]
                await deny(
                    exc.status, exc.message, exc.code, challenge if exc.status == 401 else []
                )
                return
            recorded = record(self.scheduler, refused, exc.status, exc.message)
            await deny(exc.status, exc.message, exc.code, recorded)
            return
        note_model(scope, requested)
        model = self.config.resolve_model(requested) if requested else None
        if model is None:
            message = f"model {requested!r} is not configured"
            recorded = record(self.scheduler, refused, 404, message)
            await deny(404, message, "model_not_found", recorded)
            return
        query = bytes(scope.get("query_string", b"")).decode("latin-1")
        spec = self.config.models[model]
        if spec.ignore_websockets or spec.kind is not None:
            if self.scheduler.model_status(model).state != "ready":
                await deny(409, _not_loaded(model, spec.kind), "model_not_loaded")
                return
            first: asyncio.Future[Any] = asyncio.ensure_future(receive())
            try:
                url = websocket_url(spec.proxy, path, query)
                await self._bridge(scope, first, receive, send, deny, None, model, url, headers)
            finally:
                first.cancel()
            return
        static = endpoint.startswith("/upstream") and re.search(self.config.ignore_paths, path)
        if static and not self.scheduler.is_resident(model):
            # A browser asking for a favicon must not trigger a model swap.
            message = f"model {model!r} is not loaded; static paths do not load it"
            await deny(409, message, "model_not_loaded")
            return
        admission = Admission(
            model=model,
            model_requested=requested or model,
            endpoint=endpoint,
            priority=identity.grant(asked),
            requested_priority=asked,
            priority_unreadable=unreadable_priority(headers.get(HEADER.lower())),
            caller=identity.caller,
            max_wait_ns=max_wait,
        )
        try:
            ticket = self.scheduler.admit(admission)
        except Refused as exc:
            self.scheduler.refused(admission, exc)
            extra = retry_after(exc.retry_after) + request_id_header(exc.recorded_as)
            await deny(exc.status, str(exc), exc.code, extra)
            return
        current = asyncio.current_task()
        assert current is not None
        # Whatever this handler does from here, the request ends when it does.
        self.scheduler.supervise(ticket.request_id, current)
        # Until the socket opens, the client can send nothing but its leaving.
        first = asyncio.ensure_future(receive())
        try:
            waiting: list[asyncio.Future[Any]] = [ticket.ready, ticket.detached, first]
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if ticket.detached.done():
                why = ticket.detached.result()
                await deny(why.status, why.message, why.code, retry_after(why.retry_after))
                return
            if not ticket.ready.done():
                self.scheduler.client_gone(ticket.request_id)
                return
            if ticket.ready.cancelled():
                return
            failure = ticket.ready.exception()
            if failure is not None:  # the scheduler has recorded it, as for HTTP
                message = f"model {model!r} failed to start: {failure}"
                status, code = start_failure(failure)
                await deny(status, message, code)
                return
            url = websocket_url(ticket.ready.result(), path, query)
            target = self.scheduler.target_of(ticket.request_id, ticket.model)
            await self._bridge(scope, first, receive, send, deny, ticket, target, url, headers)
        finally:
            first.cancel()

    def _identify(
        self, scope: Scope, headers: dict[str, str], endpoint: str, *, admin_only: bool
    ) -> Identity:
        # The key was checked by the key middleware, which put its identity in the scope.
        found = identify(scope, headers)
        if admin_only and found.role != "admin":
            where = "/" + endpoint.lstrip("/").split("/", 1)[0]  # /upstream, /comfyui
            raise BadRequest(403, f"{where} needs an admin API key", "admin_key_required")
        return found

    async def _bridge(
        self,
        scope: Scope,
        first: asyncio.Future[Any],
        receive: Receive,
        send: Send,
        deny: _Denial,
        ticket: Ticket | None,
        model: str,
        url: str,
        headers: dict[str, str],
    ) -> None:
        """Open the upstream's socket and pass messages both ways. TICKET is the
        scheduler's request; None for an ignored websocket, which reports nothing."""
        tracked = _Tracked(self.scheduler, ticket)
        spec = self.config.models[model]
        passed = {k: v for k, v in headers.items() if k not in HANDSHAKE_HEADERS}
        forward, dropped = outgoing_headers(passed, pass_credentials=spec.pass_credentials)
        sent = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in forward]
        sent += list(spec.headers.items())
        tracked.started(dropped)
        t0 = time.monotonic()
        try:
            upstream = await connect(
                url,
                additional_headers=sent,
                subprotocols=scope.get("subprotocols") or None,  # type: ignore[arg-type]
                open_timeout=spec.connect_timeout,
                user_agent_header=None,  # the client's own, if any, is in `sent`
                compression=None,
                ping_interval=None,  # the client and the upstream keep their own pace
                max_size=None,
            )
        except InvalidStatus as exc:
            # The upstream's refusal (401, 404, ...) is the client's answer.
            response = exc.response
            message = f"upstream refused the websocket with HTTP {response.status_code}"
            tracked.failed(message, response.status_code)
            body = bytes(response.body or b"")
            back = [
                (k.lower().encode("latin-1"), v.encode("latin-1"))
                for k, v in response.headers.raw_items()
                if k.lower() not in HOP_BY_HOP
            ]
            back.append((b"content-length", str(len(body)).encode()))
            await deny.raw(response.status_code, back, body)
            return
        except (OSError, InvalidHandshake, TimeoutError) as exc:
            message = f"upstream websocket failed: {type(exc).__name__}: {exc}"
            tracked.failed(message, 502)
            await deny(502, message, "upstream_error")
            return
        async with upstream:
            await send(
                {
                    "type": "websocket.accept",
                    "subprotocol": upstream.subprotocol,
                    "headers": [] if ticket is None else ticket_headers(ticket),
                }
            )
            counted = _Counter()
            inbound = asyncio.ensure_future(_client_to_upstream(first, receive, upstream))
            outbound = asyncio.ensure_future(_upstream_to_client(upstream, send, counted))
            watched: set[asyncio.Future[Any]] = {inbound, outbound}
            if ticket is not None:
                watched.add(ticket.detached)
            try:
                await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (inbound, outbound):
                    if not task.done():
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError, Exception):
                            await task
            if ticket is not None and ticket.detached.done():
                why: Detached = ticket.detached.result()
                code = 1001 if why.code == "shutting_down" else 1011
                reason = why.message.encode()[:123].decode(errors="ignore")
                await upstream.close(code, reason)
                await _close_client(send, code, reason)
                return
            if inbound.done() and not inbound.cancelled() and inbound.exception() is None:
                code, reason = inbound.result()  # the client closed: so does the upstream
                await upstream.close(code if _sendable(code) else 1000, reason)
            else:  # the upstream closed (or failed): so does the client
                code = upstream.close_code or 1000
                reason = upstream.close_reason or ""
                await _close_client(send, code if _sendable(code) else 1011, reason)
        tracked.completed(counted.bytes, (time.monotonic() - t0) * 1000)


_LOADED_BY = {"comfyui": "a prompt (POST /comfyui/prompt)", "openai-videos": "POST /v1/videos"}


def _not_loaded(model: str, kind: str | None) -> str:
    if kind is None:
        return f"model {model!r} is not loaded; ignored websocket requests cannot start it"
    loads = _LOADED_BY.get(kind, "one of its jobs")
    return (
        f"model {model!r} (kind {kind}) is not loaded: its websocket is a side channel, "
        f"answered only while it runs, and only {loads} loads it"
    )


class _Counter:
    bytes = 0


class _Tracked:
    """What the bridge tells the scheduler about its request; nothing for an
    ignored websocket (no ticket)."""

    def __init__(self, scheduler: Scheduler, ticket: Ticket | None) -> None:
        self._scheduler = scheduler
        self._rid = None if ticket is None else ticket.request_id

    def started(self, dropped: Any) -> None:
        if self._rid is not None:
            self._scheduler.started(self._rid, dropped)

    def failed(self, message: str, status: int) -> None:
        if self._rid is not None:
            self._scheduler.failed(self._rid, message, status)

    def completed(self, size: int, run_ms: float) -> None:
        if self._rid is not None:
            self._scheduler.completed(self._rid, 101, bytes=size, run_ms=run_ms)


async def _client_to_upstream(
    first: asyncio.Future[Any], receive: Receive, upstream: ClientConnection
) -> tuple[int, str]:
    message = await first
    while message["type"] != "websocket.disconnect":
        if message["type"] == "websocket.receive":
            text = message.get("text")
            await upstream.send(text if text is not None else message.get("bytes") or b"")
        message = await receive()
    return int(message.get("code") or 1000), str(message.get("reason") or "")


async def _upstream_to_client(upstream: ClientConnection, send: Any, counted: _Counter) -> None:
    with contextlib.suppress(ConnectionClosed):
        async for data in upstream:
            if isinstance(data, str):
                counted.bytes += len(data.encode())
                await send({"type": "websocket.send", "text": data})
            else:
                counted.bytes += len(data)
                await send({"type": "websocket.send", "bytes": bytes(data)})


async def _close_client(send: Any, code: int, reason: str) -> None:
    with contextlib.suppress(Exception):  # the client may be gone already
        await send({"type": "websocket.close", "code": code, "reason": reason})


def _sendable(code: int) -> bool:
    return 1000 <= code <= 4999 and code not in _UNSENDABLE


class _Denial:
    """An upgrade refused before it opens, in gpulane's error shape (app/web/errors.py)."""

    def __init__(self, scope: Scope, send: Send) -> None:
        self._scope = scope
        self._send = send

    async def __call__(
        self,
        status: int,
        message: str,
        code: str | None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        await send_websocket_error(
            self._scope, self._send, status, message, code=code, headers=headers
        )

    async def raw(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        await send_websocket_refusal(self._scope, self._send, status, headers, body)


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


class Upgrades:
    """Where the routes hand their websocket upgrades: `/upstream/MODEL/PATH`
    (admin only, as the route is) and the model-dispatched GET routes."""

    def __init__(self, proxy: WebsocketProxy) -> None:
        self.proxy = proxy

    async def on_upstream(self, scope: Scope, receive: Receive, send: Send, raw_path: str) -> None:
        # The longest configured id or alias the path starts with, as for HTTP.
        rest = raw_path.removeprefix("/upstream").lstrip("/")
        found = model_in_path(self.proxy.config.name_index, rest)
        requested: str | None
        if found is not None:
            requested, path = found[0], found[2]
        else:  # named in the error: the first segment, as for HTTP
            first, _, tail = rest.partition("/")
            requested, path = unquote(first) or None, "/" + tail
        endpoint = "/upstream" + path
        await self.proxy.serve(scope, receive, send, requested, path, endpoint, admin_only=True)

    async def on_model_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = scope["path"]
        try:
            requested = query_model(scope.get("query_string", b""))
        except BadRequest as exc:
            await receive()  # websocket.connect
            await _Denial(scope, send)(exc.status, exc.message, exc.code)
            return
        path = forwarded_path(endpoint)
        await self.proxy.serve(scope, receive, send, requested, path, endpoint)
