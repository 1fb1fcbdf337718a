"""What the HTTP server accepts from a client before a request exists.

Enforced in uvicorn's httptools protocol, while the request head is parsed, so
a refused head never reaches the app (nor the queue) and never takes more
memory than the limit plus one read: an ASGI middleware would only see the
headers after uvicorn had buffered all of them.

- A request head (request line and headers) may have at most `MAX_HEADERS`
  header fields and `MAX_HEAD_BYTES` bytes; more gets 431.
- A client must finish a request head within `HEAD_TIMEOUT_S` of opening the
  connection or of starting the request; a client that stops half-way gets 408
  and the connection is closed, one that never sent a byte is just closed.
- An idle keep-alive connection is closed after `KEEP_ALIVE_S`.

Answers are in the OpenAI error shape, written straight to the socket.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from app.web.console.security import security_header_lines
from app.web.errors import error_body

log = logging.getLogger("gpulane.http")

MAX_HEADERS = 100
"""Header fields per request (Apache's LimitRequestFields default)."""
MAX_HEAD_BYTES = 64 * 1024
"""Request line plus headers, in bytes (4x nginx's default of 4 x 8 KiB buffers)."""
HEAD_TIMEOUT_S = 10.0
"""Seconds a client has to send a whole request head."""
KEEP_ALIVE_S = 5
"""Seconds an idle keep-alive connection stays open between requests (uvicorn's default)."""
LINGER_S = 2.0
"""Seconds a refused connection is still read (and discarded) before it is closed."""


def server_options() -> dict[str, Any]:
    """Keyword arguments for `uvicorn.Config` that apply these limits."""
    return {"http": BoundedHttpToolsProtocol, "timeout_keep_alive": KEEP_ALIVE_S}


class _HeadRefused(Exception):
    """Raised from a parser callback to stop parsing a head that is over a limit."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with limits on the request head and a head deadline."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_head = True  # between requests or inside a head, not in a body
        self._head_received = 0  # raw bytes received while in a head
        self._header_count = 0
        self._header_bytes = 0
        self._refusal: str | None = None
        self._refused = False

    # Connection events

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # uvicorn's own, with the refusals below and errors in the OpenAI shape.
        if self._refused or self.transport.is_closing():
            return  # the rest of a refused request, discarded
        self._unset_keepalive_if_required()
        if self._in_head:
            self._head_received += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as exc:
            if self._refusal is not None:
                self._refuse(431, self._refusal, "request_header_fields_too_large")
            else:
                self._refuse(400, f"invalid HTTP request: {exc}", "invalid_http_request")
            return
        if self._in_head and self._head_received > MAX_HEAD_BYTES:
            # Headers that never end: refused without waiting for the rest.
            self._refuse(431, _too_large_message(), "request_header_fields_too_large")

    # Parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._header_count = 0
        self._header_bytes = 0
        if self._head_timer is None:
            self._arm_head_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._header_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if self._header_count > MAX_HEADERS:
            self._refusal = (
                f"request has more than {MAX_HEADERS} header fields; "
                f"gpulane accepts at most {MAX_HEADERS}"
            )
            raise _HeadRefused
        if len(self.url) + self._header_bytes > MAX_HEAD_BYTES:
            self._refusal = _too_large_message()
            raise _HeadRefused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        self._in_head = False
        self._head_received = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True

    # Refusals

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined head waits behind a running request; that wait is ours.
            self._arm_head_timer()
        elif self._head_received:
            self._refuse(
                408,
                f"request head (request line and headers) not complete within {HEAD_TIMEOUT_S:g} s",
                "request_timeout",
            )
        else:
            self.transport.close()

    def _refuse(self, status: int, message: str, code: str) -> None:
        log.info("refused a request from %s with %d: %s", _peer(self.client), status, message)
        body = error_body(status, message, code)
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            security_header_lines(),
            b"content-type: application/json\r\n",
            b"content-length: " + str(len(body)).encode() + b"\r\n",
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self._refused = True
        self._cancel_head_timer()
        # Closing at once, with the client's unread bytes still arriving, would
        # reset the connection and could destroy the answer before the client
        # reads it; so half-close, discard what still comes, and close a little later.
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()


def _too_large_message() -> str:
    return (
        f"request line and headers are larger than {MAX_HEAD_BYTES} bytes; "
        f"gpulane accepts at most {MAX_HEAD_BYTES}"
    )


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"
