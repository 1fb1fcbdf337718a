"""Health checks of an upstream's port: whether it is local, whether it answers.

Kept apart from upstream.py, which starts and stops the process and uses these.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from urllib.parse import SplitResult, urlsplit

import httpx

PROBE_MAX_BODY = 64 * 1024


class HttpProbe:
    """GET one URL over a bare connection; each call returns the HTTP status.

    No httpx client: making one costs about 40 ms (its TLS context), more than
    gpulane may add to a whole swap, and a plain-HTTP check needs nothing of it.
    The name is resolved once, and the address that answered is tried first
    (`localhost` may name ::1 before the 127.0.0.1 the server listens on)."""

    def __init__(self, url: SplitResult) -> None:
        self._url = url
        target = (url.path or "/") + (f"?{url.query}" if url.query else "")
        host = url.netloc.rpartition("@")[2]
        self._request = (
            f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
        ).encode("latin-1")
        self._addresses: list[str] = []

    async def __call__(self, timeout: float) -> int:
        async with asyncio.timeout(timeout):
            reader, writer = await self._connect()
            try:
                writer.write(self._request)
                status_line = await reader.readline()
                length = 0
                while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length" and value.strip().isdigit():
                        length = int(value)
                if 0 < length <= PROBE_MAX_BODY:
                    # Closing with unread data would reset the connection under the server.
                    with contextlib.suppress(asyncio.IncompleteReadError):
                        await reader.readexactly(length)
            finally:
                writer.close()
        if not status_line:
            raise ConnectionError("closed without an answer")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            raise ValueError(f"not an HTTP response: {status_line[:100]!r}")
        return int(parts[1])

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        port = self._url.port or 80
        if not self._addresses:
            infos = await asyncio.get_running_loop().getaddrinfo(
                self._url.hostname, port, type=socket.SOCK_STREAM
            )
            self._addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        error: OSError | None = None
        for address in list(self._addresses):
            try:
                streams = await asyncio.open_connection(address, port)
            except OSError as exc:
                error = exc
                continue
            self._addresses.remove(address)
            self._addresses.insert(0, address)
            return streams
        assert error is not None
        raise error


async def probe_httpx(client: httpx.AsyncClient, url: str, timeout: float) -> int:
    return (await client.get(url, timeout=timeout)).status_code


def local_port(proxy: str) -> int | None:
    """The port of PROXY when it names this machine (loopback or wildcard), else None."""
    parts = urlsplit(proxy)
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None
    host = (parts.hostname or "").lower()
    if port is None or not host:
        return None
    if host == "localhost" or host.endswith(".localhost"):
        return port
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None  # a name: another machine, or a container's own address
    return port if address.is_loopback or address.is_unspecified else None


def accepts_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False
