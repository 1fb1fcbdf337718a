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

Below httpcore, a plain-HTTP upstream's sockets are the event loop's own
(`SocketBackend`: `sock_recv`, `sock_sendall`), not anyio's streams, whose
cancel scopes cost more than the system calls they wrap; TLS (an `https` peer)
keeps httpcore's default backend.

Errors are httpcore's (`ConnectError`, `ReadError`, `RemoteProtocolError`, ...,
all `httpcore.NetworkError` or `httpcore.ProtocolError`), named as httpx names
them.
"""

from __future__ import annotations

import asyncio
import select
import socket
from collections.abc import AsyncIterator, Iterable
from typing import Any
from urllib.parse import urlsplit

import httpcore

KEEP = 64
"""Idle connections kept per model (httpx's `max_keepalive_connections` before)."""
KEEPALIVE_S = 5.0
"""An idle connection older than this is closed, not reused (httpx's default)."""

UpstreamError = (httpcore.NetworkError, httpcore.ProtocolError, httpcore.TimeoutException)
"""What a request to an upstream raises when the exchange itself fails."""
NoAnswer = (httpcore.ConnectError, httpcore.ReadError, httpcore.RemoteProtocolError)
"""An upstream that gave no answer at all (it may have just died)."""


CORK = 16 * 1024
"""Bytes of a request held back until it is complete (`_Socket.write`)."""


class _Socket(httpcore.AsyncNetworkStream):
    """A connected non-blocking socket, read and written through the event loop.
    A small request goes in one system call: httpcore writes its head and its
    body apart, and what is written is held (up to `CORK` bytes) until the
    answer is read."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._held = b""

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._held:
            held, self._held = self._held, b""
            await self._send(held, timeout)
        try:
            if timeout is None:
                return await self._loop.sock_recv(self._sock, max_bytes)
            async with asyncio.timeout(timeout):
                return await self._loop.sock_recv(self._sock, max_bytes)
        except TimeoutError as exc:
            raise httpcore.ReadTimeout(str(exc)) from exc
        except OSError as exc:
            raise httpcore.ReadError(str(exc)) from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if len(self._held) + len(buffer) <= CORK:
            self._held += buffer
            return
        if self._held:
            held, self._held = self._held, b""
            await self._send(held, timeout)
        await self._send(buffer, timeout)

    async def _send(self, buffer: bytes, timeout: float | None) -> None:
        try:
            if timeout is None:
                await self._loop.sock_sendall(self._sock, buffer)
                return
            async with asyncio.timeout(timeout):
                await self._loop.sock_sendall(self._sock, buffer)
        except TimeoutError as exc:
            raise httpcore.WriteTimeout(str(exc)) from exc
        except OSError as exc:
            raise httpcore.WriteError(str(exc)) from exc

    async def aclose(self) -> None:
        self._sock.close()

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            # Readable while idle: the server closed it (or sent what nobody asked for).
            if self._sock.fileno() < 0:
                return True
            poller = select.poll()
            poller.register(self._sock, select.POLLIN)
            return bool(poller.poll(0))
        if info == "socket":
            return self._sock
        return None


class SocketBackend(httpcore.AsyncNetworkBackend):
    """Connects plain TCP sockets on the running event loop (see the module's docstring)."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
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

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


_SOCKETS = SocketBackend()


class UpstreamResponse:
    """An upstream's answer, its body read as it comes (`chunks`); `aclose`
    hands the connection back to its pool when the exchange left it reusable."""

    __slots__ = ("_conn", "_origin", "_pool", "_response", "headers", "status_code")

    def __init__(
        self,
        pool: UpstreamPool,
        origin: str,
        conn: httpcore.AsyncHTTPConnection,
        response: httpcore.Response,
    ) -> None:
        self._pool = pool
        self._origin = origin
        self._conn = conn
        self._response = response
        self.status_code = response.status
        self.headers: list[tuple[bytes, bytes]] = response.headers

    def chunks(self) -> AsyncIterator[bytes]:
        return self._response.aiter_stream()

    async def aclose(self) -> None:
        await self._response.aclose()
        await self._pool.give_back(self._origin, self._conn)


class UpstreamPool:
    def __init__(self, connect_timeout: float | None) -> None:
        self._extensions = {"timeout": {"connect": connect_timeout}}
        self._idle: dict[str, list[httpcore.AsyncHTTPConnection]] = {}
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
        request = httpcore.Request(
            method.encode(),
            httpcore.URL(scheme=origin.scheme, host=origin.host, port=origin.port, target=target),
            headers=head,
            content=body,
            extensions=self._extensions,
        )
        conn = await self._take(base, origin)
        try:
            response = await conn.handle_async_request(request)
        except BaseException:
            await conn.aclose()
            raise
        return UpstreamResponse(self, base, conn, response)

    async def _take(self, base: str, origin: httpcore.Origin) -> httpcore.AsyncHTTPConnection:
        idle = self._idle.get(base)
        while idle:
            conn = idle.pop()  # the last to go idle: the least likely to have expired
            if conn.is_idle() and not conn.has_expired():
                return conn
            await conn.aclose()
        backend = _SOCKETS if origin.scheme == b"http" else None
        return httpcore.AsyncHTTPConnection(
            origin, keepalive_expiry=KEEPALIVE_S, network_backend=backend
        )

    async def give_back(self, base: str, conn: httpcore.AsyncHTTPConnection) -> None:
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
