"""The proxy path: admit a request, wait for its turn, stream the upstream's answer.

Raw ASGI on purpose: the body must pass through byte for byte, chunks must be
forwarded as the upstream sends them, and a client that leaves must be noticed
while it waits in the queue, which Litestar's request objects do not expose.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

import httpx
from litestar.types import Message, Receive, Scope, Send

from app.config import Config
from app.core import events as ev
from app.core.priority import HEADER, band_of, parse_priority
from app.runtime.scheduler import Admission, Refused, Scheduler, Ticket, new_request_id
from app.runtime.upstream import UpstreamStartError
from app.runtime.usage import UsageSniffer
from app.web.errors import send_error
from app.web.request_body import (
    BadRequest,
    form_model,
    json_model,
    read_body,
    rename_form_model,
    rewrite,
)

if TYPE_CHECKING:
    from app.web.jobs import JobRunner

log = logging.getLogger("gpulane.proxy")

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# The body passes through byte for byte, so its length stays; uvicorn writes the Date.
_NOT_PASSED_BACK = (HOP_BY_HOP - {"content-length"}) | {"date"}
_CREDENTIALS = frozenset({"authorization", "x-api-key"})


class Proxy:
    def __init__(self, config: Config, scheduler: Scheduler, client: httpx.AsyncClient) -> None:
        self.config = config
        self.scheduler = scheduler
        self.client = client
        self._ignore = re.compile(config.ignore_paths)
        self.jobs: JobRunner | None = None
        """Set by serve: takes requests sent with `Prefer: respond-async`."""

    def handler(
        self, source: Literal["json", "form"]
    ) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        async def handle(scope: Scope, receive: Receive, send: Send) -> None:
            await self.inference(scope, receive, send, source)

        return handle

    async def inference(self, scope: Scope, receive: Receive, send: Send, source: str) -> None:
        headers = _headers(scope)
        endpoint = scope["path"]
        priority = parse_priority(headers.get(HEADER.lower()))
        caller = scope.get("state", {}).get("caller")
        model_requested: str | None = None
        try:
            body = await read_body(receive, self.config.max_body_bytes)
            if source == "form":
                model_requested = form_model(body, headers.get("content-type", ""))
                doc = None
            else:
                doc, model_requested = json_model(body)
            model = self.config.resolve_model(model_requested)
            if model is None:
                listed = sorted(m.id for m in self.config.models.values() if not m.unlisted)
                raise BadRequest(
                    404,
                    f"model {model_requested!r} is not configured; available: {', '.join(listed)}",
                    "model_not_found",
                )
            spec = self.config.models[model]
            if doc is None and spec.use_model_name and spec.use_model_name != model_requested:
                body = rename_form_model(body, headers["content-type"], spec.use_model_name)
            elif doc is not None:
                changed = rewrite(doc, spec)
                if changed is not None:
                    body = json.dumps(changed).encode()
        except BadRequest as exc:
            self._reject(endpoint, exc.status, exc.message, model_requested, priority, caller)
            await send_error(send, exc.status, exc.message, code=exc.code)
            return
        except ConnectionError:
            return
        admission = Admission(
            model=model,
            model_requested=model_requested,
            endpoint=endpoint,
            priority=priority,
            caller=caller,
        )
        progress = (
            spec.send_loading_state
            and endpoint == "/v1/chat/completions"
            and doc is not None
            and doc.get("stream") is True
        )
        await self._run(scope, receive, send, admission, body, headers, progress=progress)

    async def upstream(self, scope: Scope, receive: Receive, send: Send) -> None:
        """/upstream/{model}/{path}: any method, passed through to that model's server."""
        params = scope["path_params"]
        model = self.config.resolve_model(params["model"])
        if model is None:
            await send_error(
                send, 404, f"model {params['model']!r} is not configured", code="model_not_found"
            )
            return
        path = "/" + params.get("path", "").lstrip("/")
        if self._ignore.search(path) and self.scheduler.state.resident != model:
            # A browser asking for a favicon must not trigger a model swap.
            await send_error(
                send,
                409,
                f"model {model!r} is not loaded; static paths do not load it",
                code="model_not_loaded",
            )
            return
        headers = _headers(scope)
        try:
            body = await read_body(receive, self.config.max_body_bytes)
        except BadRequest as exc:
            await send_error(send, exc.status, exc.message, code=exc.code)
            return
        except ConnectionError:
            return
        admission = Admission(
            model=model,
            model_requested=params["model"],
            endpoint="/upstream" + path,
            priority=parse_priority(headers.get(HEADER.lower())),
            caller=scope.get("state", {}).get("caller"),
        )
        await self._run(scope, receive, send, admission, body, headers, upstream_path=path)

    # -- one admitted request ---------------------------------------------------

    async def _run(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        admission: Admission,
        body: bytes,
        headers: dict[str, str],
        upstream_path: str | None = None,
        progress: bool = False,
    ) -> None:
        if self.jobs is not None and "respond-async" in headers.get("prefer", "").lower():
            path = upstream_path or scope["path"]
            query = bytes(scope.get("query_string", b"")).decode("latin-1")
            method = str(scope.get("method", "POST"))
            await self.jobs.accept(send, admission, method, path, query, body, headers)
            return
        try:
            ticket = self.scheduler.admit(admission)
        except Refused as exc:
            self._reject(
                admission.endpoint,
                503,
                str(exc),
                admission.model_requested,
                admission.priority,
                admission.caller,
            )
            await send_error(send, 503, str(exc), code="event_log_unavailable")
            return
        disconnected: asyncio.Future[None] = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            waiting: list[asyncio.Future[Any]] = [ticket.ready, disconnected]
            started = False
            if progress:
                # Requests served at once get no progress lines.
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED, timeout=0.05)
            if progress and not ticket.ready.done() and not disconnected.done():
                # sendLoadingState: the stream starts now and says where the request stands.
                started = True
                send = await self._send_progress(send, ticket, admission.model, disconnected)
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if not ticket.ready.done():
                self._client_gone(ticket.request_id)
                return
            if ticket.ready.cancelled():
                return
            failure = ticket.ready.exception()
            if failure is not None:
                message = f"model {admission.model!r} failed to start: {failure}"
                status = 502 if isinstance(failure, UpstreamStartError) else 500
                if started:
                    error = _sse_error(message)
                    await send({"type": "http.response.body", "body": error, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                await send_error(
                    send,
                    status,
                    message,
                    code="upstream_start_failed",
                    headers=_ticket_headers(ticket),
                )
                return
            base_url = ticket.ready.result()
            raw_query: bytes = scope.get("query_string", b"")
            url = upstream_url(
                base_url, upstream_path or scope["path"], raw_query.decode("latin-1")
            )
            streaming = asyncio.ensure_future(
                self.forward(str(scope.get("method", "GET")), url, body, headers, ticket, send)
            )
            await asyncio.wait({streaming, disconnected}, return_when=asyncio.FIRST_COMPLETED)
            if not streaming.done():
                streaming.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await streaming
                self._client_gone(ticket.request_id)
            else:
                streaming.result()  # re-raises what the forwarding task raised
        finally:
            disconnected.cancel()

    async def forward(
        self,
        method: str,
        url: str,
        body: bytes,
        headers: dict[str, str],
        ticket: Ticket,
        send: Send,
        before_completed: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Send one dispatched request upstream and stream the answer to `send`.
        `before_completed` runs once the whole answer is through and before the
        completion is recorded (durable jobs store their result there)."""
        rid = ticket.request_id
        self.scheduler.started(rid)
        t0 = time.monotonic()
        forward = {
            k: v
            for k, v in headers.items()
            if k not in HOP_BY_HOP and not (self.config.api_keys and k in _CREDENTIALS)
        }
        request = self.client.build_request(method, url, content=body, headers=forward)
        try:
            try:
                response = await self.client.send(request, stream=True)
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                # No answer at all: if the process just died, load it again and retry once.
                if not await self.scheduler.reload_crashed(rid):
                    raise
                response = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            message = f"upstream request failed: {type(exc).__name__}: {exc}"
            self.scheduler.finish(
                ev.RequestFailed(
                    at=self.scheduler.clock(), request_id=rid, error=message, http_status=502
                )
            )
            await send_error(
                send, 502, message, code="upstream_error", headers=_ticket_headers(ticket)
            )
            return
        sniffer = UsageSniffer()
        ttfb_ms: float | None = None
        try:
            out_headers = [
                (k.encode("latin-1"), v.encode("latin-1"))
                for k, v in response.headers.multi_items()
                if k.lower() not in _NOT_PASSED_BACK
            ]
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": out_headers + _ticket_headers(ticket),
                }
            )
            async for chunk in response.aiter_raw():
                if ttfb_ms is None:
                    ttfb_ms = (time.monotonic() - t0) * 1000
                sniffer.feed(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:
            # The upstream died mid-response: end the stream, record the failure.
            self.scheduler.finish(
                ev.RequestFailed(
                    at=self.scheduler.clock(),
                    request_id=rid,
                    error=f"upstream ended the response early: {type(exc).__name__}: {exc}",
                    http_status=response.status_code,
                )
            )
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        finally:
            await response.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if before_completed is not None:
            await before_completed()
        tokens_in, tokens_out, tps = sniffer.result()
        self.scheduler.finish(
            ev.RequestCompleted(
                at=self.scheduler.clock(),
                request_id=rid,
                http_status=response.status_code,
                bytes=sniffer.bytes,
                ttfb_ms=ttfb_ms,
                run_ms=(time.monotonic() - t0) * 1000,
                input_tokens=tokens_in,
                output_tokens=tokens_out,
                tokens_per_second=tps,
            )
        )

    async def _send_progress(
        self, send: Send, ticket: Ticket, model: str, disconnected: asyncio.Future[None]
    ) -> Send:
        """Start an SSE response and send a progress chunk (as `reasoning_content`,
        like llama-swap) every second until the request may run. Returns a `send`
        for the rest of the response that drops the upstream's own start message."""
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"cache-control", b"no-cache"),
                    *_ticket_headers(ticket),
                ],
            }
        )
        waiting: list[asyncio.Future[Any]] = [ticket.ready, disconnected]
        while not ticket.ready.done() and not disconnected.done():
            text = self._progress_text(ticket.request_id, model)
            await send(
                {"type": "http.response.body", "body": _sse_progress(text), "more_body": True}
            )
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED, timeout=1.0)

        async def rest(message: Message) -> None:
            if message["type"] != "http.response.start":
                await send(message)

        return rest

    def _progress_text(self, request_id: str, model: str) -> str:
        state = self.scheduler.state
        position = state.queue.position(request_id, state.resident)
        if position is not None:
            return f"gpulane: waiting in the queue, {position} ahead of this request\n"
        return f"gpulane: loading model {model}\n"

    def _client_gone(self, request_id: str) -> None:
        event = ev.RequestCancelled(
            at=self.scheduler.clock(), request_id=request_id, reason="client_gone"
        )
        if (
            not self.scheduler.cancel(request_id, "client_gone")
            and request_id in self.scheduler.state.requests
        ):
            self.scheduler.finish(event)

    def _reject(
        self,
        endpoint: str,
        status: int,
        message: str,
        model: str | None,
        priority: int,
        caller: str | None,
    ) -> None:
        self.scheduler.emit(
            [
                ev.RequestRejected(
                    at=self.scheduler.clock(),
                    request_id=new_request_id(),
                    endpoint=endpoint,
                    http_status=status,
                    error=message,
                    model_requested=model,
                    priority=priority,
                    band=band_of(priority),
                    caller=caller,
                )
            ]
        )


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def _ticket_headers(ticket: Ticket) -> list[tuple[bytes, bytes]]:
    out = [(b"x-request-id", ticket.request_id.encode()), (b"x-gpulane-band", ticket.band.encode())]
    if ticket.score is not None:
        out.append((b"x-gpulane-score", f"{ticket.score:.3f}".encode()))
    if ticket.queue_wait_ms is not None:
        out.append((b"x-gpulane-queue-wait-ms", f"{ticket.queue_wait_ms:.1f}".encode()))
    return out


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def upstream_url(base_url: str, path: str, query: str) -> str:
    return base_url.rstrip("/") + path + (f"?{query}" if query else "")


def _sse_progress(text: str) -> bytes:
    chunk = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"reasoning_content": text}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _sse_error(message: str) -> bytes:
    return (
        b"data: "
        + json.dumps({"error": {"message": message, "type": "upstream_error"}}).encode()
        + b"\n\n"
    )
