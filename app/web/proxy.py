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
from app.core.priority import HEADER, parse_priority
from app.runtime.scheduler import Admission, Detached, Refused, Scheduler, Ticket
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
            self.scheduler.reject(
                endpoint, exc.status, exc.message, model_requested, priority, caller
            )
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
            self.scheduler.reject(
                admission.endpoint,
                503,
                str(exc),
                admission.model_requested,
                admission.priority,
                admission.caller,
            )
            await send_error(send, 503, str(exc), code="event_log_unavailable")
            return
        current = asyncio.current_task()
        assert current is not None
        # Whatever this handler does from here, the request ends when it does.
        self.scheduler.supervise(ticket.request_id, current)
        disconnected: asyncio.Future[None] = asyncio.ensure_future(_wait_disconnect(receive))
        out = Reply(send, ticket)
        try:
            waiting: list[asyncio.Future[Any]] = [ticket.ready, disconnected, ticket.detached]
            if progress:
                # Requests served at once get no progress lines.
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED, timeout=0.05)
            if progress and not any(f.done() for f in waiting):
                # sendLoadingState: the stream starts now and says where the request stands.
                out = Reply(
                    await self._send_progress(send, ticket, admission.model, waiting),
                    ticket,
                    started_as_sse=True,
                )
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if ticket.detached.done():
                await out.error(ticket.detached.result())
                return
            if not ticket.ready.done():
                self.scheduler.client_gone(ticket.request_id)
                return
            if ticket.ready.cancelled():
                return
            failure = ticket.ready.exception()
            if failure is not None:
                message = f"model {admission.model!r} failed to start: {failure}"
                status = 502 if isinstance(failure, UpstreamStartError) else 500
                await out.error(Detached(status, "upstream_start_failed", message))
                return
            raw_query: bytes = scope.get("query_string", b"")
            url = upstream_url(
                ticket.ready.result(), upstream_path or scope["path"], raw_query.decode("latin-1")
            )
            method = str(scope.get("method", "GET"))
            await self.forward(method, url, body, headers, ticket, out, disconnected=disconnected)
        finally:
            disconnected.cancel()

    async def forward(
        self,
        method: str,
        url: str,
        body: bytes,
        headers: dict[str, str],
        ticket: Ticket,
        out: Reply,
        *,
        disconnected: asyncio.Future[None] | None = None,
        before_completed: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Send one dispatched request upstream and stream the answer to `out`,
        until the answer ends, the client leaves, or the scheduler takes the
        request away (time limit, operator, shutdown): then the upstream
        connection is closed at once, whether or not the upstream answers.
        `before_completed` runs once the whole answer is through and before the
        completion is recorded (durable jobs store their result there)."""
        exchange = asyncio.ensure_future(
            self._exchange(method, url, body, headers, ticket, out, before_completed)
        )
        watched: set[asyncio.Future[Any]] = {exchange, ticket.detached}
        if disconnected is not None:
            watched.add(disconnected)
        try:
            await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not exchange.done():
                exchange.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await exchange
        rid = ticket.request_id
        if not exchange.cancelled() and exchange.exception() is not None:
            exc = exchange.exception()
            log.error("forwarding request %s failed", rid, exc_info=exc)
            message = f"internal error while forwarding: {type(exc).__name__}: {exc}"
            self.scheduler.failed(rid, message, 500)
            await out.error(Detached(500, "internal_error", message))
        elif ticket.detached.done():
            await out.error(ticket.detached.result())
        elif exchange.cancelled():  # cut short because the client left
            self.scheduler.client_gone(rid)

    async def _exchange(
        self,
        method: str,
        url: str,
        body: bytes,
        headers: dict[str, str],
        ticket: Ticket,
        out: Reply,
        before_completed: Callable[[], Awaitable[None]] | None,
    ) -> None:
        rid = ticket.request_id
        spec = self.config.models[ticket.model]
        forward, dropped = outgoing_headers(headers, strip_credentials=bool(self.config.api_keys))
        if dropped:
            log.warning("request %s: headers not forwarded (not valid HTTP): %s", rid, dropped)
        self.scheduler.started(rid, dropped)
        t0 = time.monotonic()
        request = self.client.build_request(
            method,
            url,
            content=body,
            headers=forward,
            timeout=httpx.Timeout(None, connect=spec.connect_timeout),
        )
        header_limit = spec.response_header_timeout
        try:
            try:
                async with asyncio.timeout(header_limit):
                    try:
                        response = await self.client.send(request, stream=True)
                    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                        # No answer at all: if the process just died, load it again, retry once.
                        if not await self.scheduler.reload_crashed(rid):
                            raise
                        response = await self.client.send(request, stream=True)
            except TimeoutError:
                message = (
                    f"upstream {ticket.model!r} sent no response headers within "
                    f"timeouts.responseHeader ({header_limit:g} s)"
                )
                self.scheduler.failed(rid, message, 504, hung=True)
                await out.error(Detached(504, "upstream_timeout", message))
                return
        except httpx.HTTPError as exc:
            message = f"upstream request failed: {type(exc).__name__}: {exc}"
            self.scheduler.failed(rid, message, 502)
            await out.error(Detached(502, "upstream_error", message))
            return
        sniffer = UsageSniffer()
        ttfb_ms: float | None = None
        idle_limit = spec.stream_idle_timeout
        try:
            await out.start(response.status_code, response.headers.raw)
            chunks = response.aiter_raw()
            while True:
                try:
                    async with asyncio.timeout(idle_limit):
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                if ttfb_ms is None:
                    ttfb_ms = (time.monotonic() - t0) * 1000
                sniffer.feed(chunk)
                await out.body(chunk)
        except TimeoutError:
            message = (
                f"upstream {ticket.model!r} sent nothing for streamIdleTimeout "
                f"({idle_limit:g} s) in the middle of its response"
            )
            self.scheduler.failed(rid, message, response.status_code, hung=True)
            await out.error(Detached(504, "upstream_timeout", message))
            return
        except httpx.HTTPError as exc:
            # The upstream died mid-response: end the stream, record the failure.
            self.scheduler.failed(
                rid,
                f"upstream ended the response early: {type(exc).__name__}: {exc}",
                response.status_code,
            )
            with contextlib.suppress(Exception):
                await out.end()
            return
        finally:
            await response.aclose()
        await out.end()
        if before_completed is not None:
            await before_completed()
        tokens_in, tokens_out, tps = sniffer.result()
        self.scheduler.completed(
            rid,
            response.status_code,
            bytes=sniffer.bytes,
            ttfb_ms=ttfb_ms,
            run_ms=(time.monotonic() - t0) * 1000,
            input_tokens=tokens_in,
            output_tokens=tokens_out,
            tokens_per_second=tps,
        )

    async def _send_progress(
        self, send: Send, ticket: Ticket, model: str, waiting: list[asyncio.Future[Any]]
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
        while not any(f.done() for f in waiting):
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


class Reply:
    """The client's side of one request: remembers what was sent, so an error
    can still be reported in the right form at any point."""

    def __init__(self, send: Send, ticket: Ticket, *, started_as_sse: bool = False) -> None:
        self._send = send
        self._ticket = ticket
        self.started = started_as_sse
        self.sse = started_as_sse
        self.ended = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        passed = [(k, v) for k, v in headers if k.lower().decode("latin-1") not in _NOT_PASSED_BACK]
        if not self.started:
            self.sse = any(
                k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                for k, v in passed
            )
        self.started = True
        await self._send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": passed + _ticket_headers(self._ticket),
            }
        )

    async def body(self, chunk: bytes) -> None:
        await self._send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def end(self) -> None:
        if not self.ended:
            self.ended = True
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})

    async def error(self, why: Detached) -> None:
        """An error as a JSON response, or, once the answer has started, as a
        last SSE event (if it is a stream) and the end of the body."""
        if self.ended:
            return
        with contextlib.suppress(Exception):  # the client may be gone already
            if not self.started:
                self.ended = True
                await send_error(
                    self._send,
                    why.status,
                    why.message,
                    code=why.code,
                    headers=_ticket_headers(self._ticket),
                )
                return
            if self.sse:
                await self.body(_sse_error(why.message))
            await self.end()


def _headers(scope: Scope) -> dict[str, str]:
    # latin-1 maps bytes to str one to one, so the original bytes come back
    # exactly when forwarding (`outgoing_headers`), UTF-8 or not.
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


# RFC 9110 field-value: visible ASCII, obs-text (0x80-0xff), and inner SP/HTAB.
_FIELD_VALUE = re.compile(r"[\x21-\x7e\x80-\xff]([\x20-\x7e\x80-\xff\t]*[\x21-\x7e\x80-\xff])?")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")


def outgoing_headers(
    headers: dict[str, str], *, strip_credentials: bool
) -> tuple[list[tuple[bytes, bytes]], list[str]]:
    """The headers to send upstream, as the bytes the client sent, and the
    names of those HTTP/1.1 cannot carry (dropped). Surrounding whitespace is
    not part of a value (RFC 9110 5.5), so it is trimmed, not a reason to drop."""
    out: list[tuple[bytes, bytes]] = []
    dropped: list[str] = []
    for name, value in headers.items():
        if name in HOP_BY_HOP or (strip_credentials and name in _CREDENTIALS):
            continue
        value = value.strip(" \t")
        if not _TOKEN.fullmatch(name) or not (value == "" or _FIELD_VALUE.fullmatch(value)):
            dropped.append(name)
            continue
        out.append((name.encode("latin-1"), value.encode("latin-1")))
    return out, dropped


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
