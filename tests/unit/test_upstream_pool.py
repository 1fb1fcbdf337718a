"""One model's keep-alive connections (app/web/upstream_pool.py), against a real
server on a socket: requests one after another share one connection, a
connection the server closed is never reused, and a request carries the client's
headers plus Host and Content-Length only."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from app.web.upstream_pool import UpstreamPool


class Server:
    """HTTP/1.1 on a socket: answers every request with its own head as the body;
    with `close`, closes the connection after each answer without saying so (as
    a server whose keep-alive timeout passed does)."""

    def __init__(self, close: bool = False) -> None:
        self.close = close
        self.connections = 0
        self.closed = 0
        self.heads: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                self.heads.append(head)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(head), head))
                await writer.drain()
                if self.close:
                    break
        except asyncio.IncompleteReadError:
            pass
        writer.close()
        await writer.wait_closed()
        self.closed += 1


@asynccontextmanager
async def serving(server: Server) -> AsyncIterator[str]:
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        listener.close()


async def exchange(pool: UpstreamPool, url: str, body: bytes = b"{}") -> bytes:
    response = await pool.send("POST", url, [(b"x-caller", b"me")], body)
    try:
        assert response.status_code == 200
        return b"".join([chunk async for chunk in response.chunks()])
    finally:
        await response.aclose()


def test_requests_one_after_another_share_one_connection() -> None:
    server = Server()

    async def main() -> list[bytes]:
        async with serving(server) as base:
            pool = UpstreamPool(connect_timeout=5)
            answers = [await exchange(pool, f"{base}/v1/chat/completions?n={i}") for i in range(3)]
            await pool.aclose()
            return answers

    answers = asyncio.run(main())
    assert server.connections == 1
    first = answers[0].split(b"\r\n")
    assert first[0] == b"POST /v1/chat/completions?n=0 HTTP/1.1"
    fields = sorted(line for line in first[1:] if line)
    assert [f.split(b":")[0] for f in fields] == [b"content-length", b"host", b"x-caller"]
    assert fields[0] == b"content-length: 2" and fields[1].startswith(b"host: 127.0.0.1:")


def test_a_connection_the_server_closed_is_not_reused() -> None:
    server = Server(close=True)

    async def main() -> None:
        async with serving(server) as base:
            pool = UpstreamPool(connect_timeout=5)
            for i in range(3):
                await exchange(pool, f"{base}/x")
                while server.closed <= i:  # until the server has closed it
                    await asyncio.sleep(0.001)
            await pool.aclose()

    asyncio.run(main())
    assert server.connections == 3


def test_concurrent_requests_each_get_a_connection_and_give_it_back() -> None:
    server = Server()

    async def main() -> int:
        async with serving(server) as base:
            pool = UpstreamPool(connect_timeout=5)
            await asyncio.gather(*(exchange(pool, f"{base}/x") for _ in range(8)))
            opened = server.connections
            await asyncio.gather(*(exchange(pool, f"{base}/x") for _ in range(8)))
            await pool.aclose()
            return opened

    opened = asyncio.run(main())
    assert opened == 8 and server.connections == 8  # the second round reused all eight
