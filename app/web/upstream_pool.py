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

Errors are httpcore's (`ConnectError`, `ReadError`, `RemoteProtocolError`, ...,
all `httpcore.NetworkError` or `httpcore.ProtocolError`), named as httpx names
them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
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
        return httpcore.AsyncHTTPConnection(origin, keepalive_expiry=KEEPALIVE_S)

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
