"""Forwarding one dispatched request to its model's server, for the proxy
path and for durable jobs alike.

The request's headers go as the bytes the client sent; the answer streams to a
`Reply` chunk by chunk as the upstream sends it. The model's time limits
(`timeouts.connect`, `timeouts.responseHeader`, `streamIdleTimeout`) are
enforced here; the scheduler enforces `maxRunTime` and may take the request
away at any moment (`Ticket.detached`), which closes the upstream connection
at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from litestar.types import Send

from app.config import Config
from app.config.callers import CREDENTIAL_HEADERS
from app.core.priority import priority_warning
from app.runtime.api import Detached, Ticket
from app.runtime.out_of_memory import OUT_OF_MEMORY, died_out_of_memory
from app.runtime.scheduler import Scheduler
from app.runtime.usage import UsageSniffer
from app.web.errors import error_doc, retry_after, send_error
from app.web.upstream_pool import NoAnswer, UpstreamError, UpstreamPool

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
_CREDENTIALS = CREDENTIAL_HEADERS


class _Silence:
    """`streamIdleTimeout`: ends the body loop (TimeoutError) once the upstream
    has been silent for `limit` seconds. One timer per response, moved only
    when it fires: a chunk costs a clock read, not a timer of its own.
    Time spent sending to a slow client is not the upstream's silence."""

    def __init__(self, limit: float | None) -> None:
        self._limit = limit
        self._loop = asyncio.get_running_loop()
        self._scope = asyncio.timeout(None)
        self._handle: asyncio.TimerHandle | None = None
        self.since = self._loop.time()
        self.waiting = False

    async def __aenter__(self) -> _Silence:
        await self._scope.__aenter__()
        if self._limit is not None:
            self._handle = self._loop.call_at(self.since + self._limit, self._check)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._handle is not None:
            self._handle.cancel()
        await self._scope.__aexit__(*exc)

    def listen(self) -> None:
        """Waiting for the upstream's next chunk from now."""
        self.since = self._loop.time()
        self.waiting = True

    def _check(self) -> None:
        assert self._limit is not None
        now = self._loop.time()
        if self.waiting and now - self.since >= self._limit:
            self._scope.reschedule(now)  # raises TimeoutError in the body loop
            return
        self._handle = self._loop.call_at(max(now, self.since) + self._limit, self._check)


class Forwarder:
    def __init__(
        self,
        config: Config,
        scheduler: Scheduler,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self._clients: dict[str, UpstreamPool] = {}
        """One connection pool per model, so a model's idle keep-alive
        connections can be closed before it is stopped: llama-server takes
        about 110 ms longer to exit while one is open (bench/swap_bench.py)."""

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
        # The model it runs on: its own, or for a request several peers may
        # serve, the peer the scheduler chose.
        target = self.scheduler.target_of(rid, ticket.model)
        spec = self.config.models[target]
        forward, dropped = outgoing_headers(headers, pass_credentials=spec.pass_credentials)
        if dropped:
            log.warning("request %s: headers not forwarded (not valid HTTP): %s", rid, dropped)
        self.scheduler.started(rid, dropped)
        t0 = time.monotonic()
        pool, forward = self._request(target, forward)
        server = self.scheduler.processes.get(target)  # to tell a death out of memory
        header_limit = spec.response_header_timeout
        try:
            try:
                async with asyncio.timeout(header_limit):
                    try:
                        response = await pool.send(method, url, forward, body)
                    except NoAnswer:
                        # No answer at all: if the process just died, load it again,
                        # retry once (a peer that refused: on another peer, if one
                        # serves the model).
                        if not await self.scheduler.reload_crashed(rid):
                            raise
                        moved = self.scheduler.target_of(rid, ticket.model)
                        server = self.scheduler.processes.get(moved)
                        if moved != target:
                            url = self.config.models[moved].proxy + url[len(spec.proxy) :]
                            passed = self.config.models[moved].pass_credentials
                            forward = outgoing_headers(headers, pass_credentials=passed)[0]
                            pool, forward = self._request(moved, forward)
                        response = await pool.send(method, url, forward, body)
            except TimeoutError:
                message = (
                    f"upstream {ticket.model!r} sent no response headers within "
                    f"timeouts.responseHeader ({header_limit:g} s)"
                )
                self.scheduler.failed(rid, message, 504, hung=True)
                await out.error(Detached(504, "upstream_timeout", message))
                return
        except UpstreamError as exc:
            message = f"upstream request failed: {type(exc).__name__}: {exc}"
            oom = await self.scheduler.died_out_of_memory(server)
            status, code = (502, "upstream_error") if oom is None else OUT_OF_MEMORY
            message = message if oom is None else died_out_of_memory(ticket.model, oom, message)
            self.scheduler.failed(rid, message, status)
            await out.error(Detached(status, code, message))
            return
        sniffer = UsageSniffer()
        ttfb_ms: float | None = None
        idle_limit = spec.stream_idle_timeout
        try:
            await out.start(response.status_code, response.headers)
            async with _Silence(idle_limit) as silence:
                chunks = response.chunks()
                while True:
                    silence.listen()
                    try:
                        chunk = await anext(chunks)
                    except StopAsyncIteration:
                        break
                    silence.waiting = False
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
        except UpstreamError as exc:
            # The upstream died mid-response: record the failure, and tell a stream's
            # client with a last error event (a stream that just stops reads as a
            # complete, shorter answer).
            message = f"upstream ended the response early: {type(exc).__name__}: {exc}"
            oom = await self.scheduler.died_out_of_memory(server)
            code = "upstream_error" if oom is None else OUT_OF_MEMORY[1]
            message = message if oom is None else died_out_of_memory(ticket.model, oom, message)
            self.scheduler.failed(rid, message, response.status_code)
            await out.error(Detached(502, code, message))
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

    def _request(
        self, model: str, forward: list[tuple[bytes, bytes]]
    ) -> tuple[UpstreamPool, list[tuple[bytes, bytes]]]:
        """`model`'s connection pool, and the headers to send it: the client's
        (`outgoing_headers`, as its `passCredentials` says) plus its own (a peer's apiKey)."""
        spec = self.config.models[model]
        for name, value in spec.headers.items():
            forward.append((name.encode("latin-1"), value.encode("latin-1")))
        pool = self._clients.get(model)
        if pool is None:
            pool = self._clients[model] = UpstreamPool(spec.connect_timeout)
        return pool, forward

    async def release(self, model: str) -> None:
        """Close the connections to a model's server (it is about to be stopped)."""
        client = self._clients.pop(model, None)
        if client is not None:
            await client.aclose()

    async def close(self) -> None:
        for model in list(self._clients):
            await self.release(model)


class Reply:
    """The client's side of one request: remembers what was sent, so an error
    can still be reported in the right form at any point."""

    def __init__(
        self,
        send: Send,
        ticket: Ticket,
        *,
        started_as_sse: bool = False,
        requested_priority: int | None = None,
        priority_unreadable: str | None = None,
    ) -> None:
        self._send = send
        self._ticket = ticket
        self._requested = requested_priority
        self._unreadable = priority_unreadable
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
                "headers": passed + ticket_headers(self._ticket, self._requested, self._unreadable),
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
                    headers=ticket_headers(self._ticket, self._requested, self._unreadable)
                    + retry_after(why.retry_after),
                )
                return
            if self.sse:
                await self.body(sse_error(why.message))
            await self.end()


# RFC 9110 field-value: visible ASCII, obs-text (0x80-0xff), and inner SP/HTAB.
_FIELD_VALUE = re.compile(r"[\x21-\x7e\x80-\xff]([\x20-\x7e\x80-\xff\t]*[\x21-\x7e\x80-\xff])?")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")


def outgoing_headers(
    headers: dict[str, str], *, pass_credentials: Collection[str] = ()
) -> tuple[list[tuple[bytes, bytes]], list[str]]:
    """The headers to send upstream, as the bytes the client sent, and the
    names of those HTTP/1.1 cannot carry (dropped). Credential headers go only
    if named in `pass_credentials` (the model's resolved `passCredentials`).
    Surrounding whitespace is not part of a value (RFC 9110 5.5), so it is
    trimmed, not a reason to drop."""
    out: list[tuple[bytes, bytes]] = []
    dropped: list[str] = []
    for name, value in headers.items():
        if name in HOP_BY_HOP or (name in _CREDENTIALS and name not in pass_credentials):
            continue
        value = value.strip(" \t")
        if not _TOKEN.fullmatch(name) or not (value == "" or _FIELD_VALUE.fullmatch(value)):
            dropped.append(name)
            continue
        out.append((name.encode("latin-1"), value.encode("latin-1")))
    return out, dropped


def ticket_headers(
    ticket: Ticket, requested: int | None = None, unreadable: str | None = None
) -> list[tuple[bytes, bytes]]:
    """What gpulane tells the client about its request; `requested` is the
    priority it asked for (None: nothing), next to the one it was granted, and
    `unreadable` its priority header as sent when it could not be read."""
    out = [
        (b"x-request-id", ticket.request_id.encode()),
        (b"x-gpulane-band", ticket.band.encode()),
        *priority_headers(ticket.priority, requested, unreadable),
    ]
    if ticket.score is not None:
        out.append((b"x-gpulane-score", f"{ticket.score:.3f}".encode()))
    if ticket.queue_wait_ms is not None:
        out.append((b"x-gpulane-queue-wait-ms", f"{ticket.queue_wait_ms:.1f}".encode()))
    if ticket.time_to_start_ms is not None:
        out.append((b"x-gpulane-time-to-start-ms", f"{ticket.time_to_start_ms:.1f}".encode()))
    return out


def priority_headers(
    granted: int, requested: int | None, unreadable: str | None = None
) -> list[tuple[bytes, bytes]]:
    """The priority granted, what was asked for (an unreadable header as sent:
    `unreadable_priority` made it printable ASCII), and why it was not read."""
    out = [(b"x-gpulane-priority-granted", str(granted).encode())]
    asked = str(requested) if requested is not None else unreadable
    if asked is not None:
        out.append((b"x-gpulane-priority-requested", asked.encode("ascii")))
    if unreadable is not None:
        out.append((b"x-gpulane-priority-warning", priority_warning(unreadable).encode("ascii")))
    return out


def upstream_url(base_url: str, path: str, query: str) -> str:
    return base_url.rstrip("/") + path + (f"?{query}" if query else "")


def sse_error(message: str) -> bytes:
    return b"data: " + json.dumps(error_doc(502, message)).encode() + b"\n\n"
