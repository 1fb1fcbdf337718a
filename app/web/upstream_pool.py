"""One model's keep-alive connections to its server, at O(1) a request.

The connections are httpcore's (the HTTP/1.1 layer under httpx); the pool is
ours. httpx's pool (httpcore's `ConnectionPool`) walks every connection it
holds at each request and asks each whether its socket is readable (a system
call each): at 32 requests in flight that walk was a third of gpulane's CPU
(docs/benchmarks.md). Here a request takes the connection that went idle last
and asks only it; one that expired or that its server closed is dropped and
the next one tried. httpx's request and response objects are left out too:
the client's headers go as they came (`forward.outgoing_headers`), plus `Host`
and `Content-Length`, with none of httpx's defaults (`User-Agent`,
`Accept-Encoding`: a proxy adds nothing the client did not send).

A plain-HTTP upstream (every local model server) is spoken to by `_Http11`:
the request written in one system call on the event loop's own socket
(`sock_recv`, `sock_sendall`), the answer parsed by httptools (llhttp, the
parser uvicorn reads requests with). httpcore's HTTP/1.1 layer (h11 in pure
Python, its locks and traces) was the largest part of gpulane's CPU per
request once its pool had gone (docs/benchmarks.md). TLS (an `https` peer)
keeps httpcore's connections and backend.

Errors are httpcore's (`ConnectError`, `ReadError`, `RemoteProtocolError`, ...,
all `httpcore.NetworkError` or `httpcore.ProtocolError`), named as httpx names
them.
"""

from __future__ import annotations

import asyncio
import select
import socket
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpcore
import httptools

KEEP = 64
"""Idle connections kept per model (httpx's `max_keepalive_connections` before)."""
KEEPALIVE_S = 5.0
"""An idle connection older than this is closed, not reused (httpx's default)."""

UpstreamError = (httpcore.NetworkError, httpcore.ProtocolError, httpcore.TimeoutException)
"""What a request to an upstream raises when the exchange itself fails."""
NoAnswer = (httpcore.ConnectError, httpcore.ReadError, httpcore.RemoteProtocolError)
"""An upstream that gave no answer at all (it may have just died)."""


class _Socket:
    """A connected non-blocking socket, read and written through the event loop."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._loop = asyncio.get_running_loop()

    async def read(self, max_bytes: int) -> bytes:
        try:
            return await self._loop.sock_recv(self._sock, max_bytes)
        except OSError as exc:
            raise httpcore.ReadError(str(exc)) from exc

    async def send(self, buffer: bytes) -> None:
        try:
            await self._loop.sock_sendall(self._sock, buffer)
        except OSError as exc:
            raise httpcore.WriteError(str(exc)) from exc

    def closed_by_server(self) -> bool:
        """Readable while idle: the server closed it (or sent what nobody asked for)."""
        if self._sock.fileno() < 0:
            return True
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        self._sock.close()


async def _connect(host: str, port: int, timeout: float | None) -> _Socket:
    """A plain TCP connection on the running event loop, without Nagle's delay."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            failures = []
            for family, kind, proto, _, address in infos:
                sock = socket.socket(family, kind, proto)
                try:
                    sock.setblocking(False)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    await loop.sock_connect(sock, address)
                except BaseException as exc:
                    sock.close()
                    if not isinstance(exc, OSError):
                        raise
                    failures.append(f"{host}:{port}: {exc.strerror or exc}")
                    continue
                return _Socket(sock)
    except TimeoutError as exc:
        raise httpcore.ConnectTimeout(f"no connection within {timeout:g} s") from exc
    except OSError as exc:  # the name did not resolve
        raise httpcore.ConnectError(str(exc)) from exc
    raise httpcore.ConnectError("; ".join(failures) or f"{host} has no address")


READ_SIZE = 64 * 1024
"""Bytes asked of an upstream's socket at a time (httpcore's figure)."""


class _Http11:
    """One plain-HTTP/1.1 connection: one exchange at a time, the answer parsed by
    httptools as it comes. Its errors are httpcore's, so callers see one set."""

    def __init__(self, sock: _Socket) -> None:
        self._sock = sock
        self._idle_since = time.monotonic()
        self._busy = False
        self._keep = False
        self._parser: httptools.HttpResponseParser | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._pieces: list[bytes] = []
        self._head_done = False
        self._complete = False

    # httptools' callbacks, while `feed_data` runs
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._head_done = True

    def on_body(self, body: bytes) -> None:
        self._pieces.append(body)

    def on_message_complete(self) -> None:
        self._complete = True
        assert self._parser is not None
        self._keep = self._parser.should_keep_alive()

    async def send(
        self, method: bytes, target: bytes, head: list[tuple[bytes, bytes]], body: bytes
    ) -> tuple[int, list[tuple[bytes, bytes]]]:
        """Write the request; the answer's status and headers once they are in."""
        if any(c <= 0x20 or c == 0x7F for c in target):
            raise httpcore.LocalProtocolError(f"not a valid request target: {target!r}")
        self._busy = True
        self._keep = self._complete = self._head_done = False
        self._pieces = []
        lines = [method, b" ", target, b" HTTP/1.1\r\n"]
        for name, value in head:
            lines += (name, b": ", value, b"\r\n")
        lines += (b"\r\n", body)
        await self._sock.send(b"".join(lines))
        parser = self._parser = httptools.HttpResponseParser(self)
        while True:
            self._headers = []
            while not self._head_done:
                await self._feed()
            status = parser.get_status_code()
            if status >= 200 or status == 101:
                break
            self._head_done = self._complete = False  # 100 Continue: the answer follows
        if method == b"HEAD":  # no body follows, whatever the headers say
            self._complete, self._keep = True, False
        return status, self._headers

    async def aiter_stream(self) -> AsyncIterator[bytes]:
        """The body, piece by piece as it arrives."""
        while True:
            if self._pieces:
                pieces, self._pieces = self._pieces, []
                yield pieces[0] if len(pieces) == 1 else b"".join(pieces)
            if self._complete:
                return
            await self._feed()

    async def _feed(self) -> None:
        data = await self._sock.read(READ_SIZE)
        if not data:
            if self._head_done and not any(
                name.lower() in (b"content-length", b"transfer-encoding")
                for name, _ in self._headers
            ):
                self._complete = True  # a body that ends when the connection does
                return
            raise httpcore.RemoteProtocolError(
                "peer closed connection without sending complete message body"
                if self._head_done
                else "Server disconnected without sending a response."
            )
        assert self._parser is not None
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise httpcore.RemoteProtocolError(f"invalid HTTP response: {exc}") from exc

    async def finish(self) -> None:
        """The exchange is over: reusable if the answer was read to its end."""
        self._busy = False
        self._idle_since = time.monotonic()
        if not (self._complete and self._keep):
            self._keep = False
            await self.aclose()

    def is_idle(self) -> bool:
        return not self._busy and self._keep

    def has_expired(self) -> bool:
        stale = time.monotonic() - self._idle_since > KEEPALIVE_S
        return stale or self._sock.closed_by_server()

    async def aclose(self) -> None:
        self._keep = False
        self._sock.close()


_Connection = _Http11 | httpcore.AsyncHTTPConnection


class UpstreamResponse:
    """An upstream's answer, its body read as it comes (`chunks`); `aclose`
    hands the connection back to its pool when the exchange left it reusable."""

    __slots__ = ("_conn", "_origin", "_pool", "_response", "headers", "status_code")

    def __init__(
        self,
        pool: UpstreamPool,
        origin: str,
        conn: _Connection,
        status: int,
        headers: list[tuple[bytes, bytes]],
        response: httpcore.Response | None = None,
    ) -> None:
        self._pool = pool
        self._origin = origin
        self._conn = conn
        self._response = response
        self.status_code = status
        self.headers = headers

    def chunks(self) -> AsyncIterator[bytes]:
        if self._response is not None:
            return self._response.aiter_stream()
        assert isinstance(self._conn, _Http11)
        return self._conn.aiter_stream()

    async def aclose(self) -> None:
        if self._response is not None:
            await self._response.aclose()
        else:
            assert isinstance(self._conn, _Http11)
            await self._conn.finish()
        await self._pool.give_back(self._origin, self._conn)


class UpstreamPool:
    def __init__(self, connect_timeout: float | None) -> None:
        self._connect_timeout = connect_timeout
        self._extensions = {"timeout": {"connect": connect_timeout}}
        self._idle: dict[str, list[_Connection]] = {}
        """Base URL -> its idle connections, the last to go idle last."""
        self._origins: dict[str, tuple[httpcore.Origin, bytes]] = {}
        """Base URL (scheme and host) -> its origin and Host header, parsed once."""
        self._closed = False

    async def send(
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> UpstreamResponse:
        """Send a request; its answer once the upstream's headers are in."""
        split = urlsplit(url)
        base = url[: len(split.scheme) + 3 + len(split.netloc)]
        known = self._origins.get(base)
        if known is None:
            port = split.port or (443 if split.scheme == "https" else 80)
            origin = httpcore.Origin(split.scheme.encode(), (split.hostname or "").encode(), port)
            host = split.netloc.rpartition("@")[2].encode("latin-1")
            known = self._origins[base] = (origin, host)
        origin, host = known
        head = [(b"host", host), *headers]
        if body or method in ("POST", "PUT", "PATCH"):
            head.append((b"content-length", str(len(body)).encode()))
        target = url[len(base) :] or "/"
        conn = await self._take(base, origin)
        try:
            if isinstance(conn, _Http11):
                status, answer = await conn.send(method.encode(), target.encode(), head, body)
                return UpstreamResponse(self, base, conn, status, answer)
            request = httpcore.Request(
                method.encode(),
                httpcore.URL(
                    scheme=origin.scheme, host=origin.host, port=origin.port, target=target
                ),
                headers=head,
                content=body,
                extensions=self._extensions,
            )
            response = await conn.handle_async_request(request)
        except BaseException:
            await conn.aclose()
            raise
        return UpstreamResponse(self, base, conn, response.status, response.headers, response)

    async def _take(self, base: str, origin: httpcore.Origin) -> _Connection:
        idle = self._idle.get(base)
        while idle:
            conn = idle.pop()  # the last to go idle: the least likely to have expired
            if conn.is_idle() and not conn.has_expired():
                return conn
            await conn.aclose()
        if origin.scheme == b"http":
            sock = await _connect(origin.host.decode("ascii"), origin.port, self._connect_timeout)
            return _Http11(sock)
        return httpcore.AsyncHTTPConnection(origin, keepalive_expiry=KEEPALIVE_S)

    async def give_back(self, base: str, conn: _Connection) -> None:
        idle = self._idle.setdefault(base, [])
        if self._closed or not conn.is_idle() or len(idle) >= KEEP:
            await conn.aclose()
            return
        idle.append(conn)

    async def aclose(self) -> None:
        """Close every idle connection; those in use close as their exchange ends."""
        self._closed = True
        for idle in self._idle.values():
            while idle:
                await idle.pop().aclose()
