"""One model's keep-alive connections (app/web/upstream_pool.py), against a real
server on a socket: requests one after another share one connection, a
connection the server closed is never reused, and a request carries the client's
headers plus Host and Content-Length only."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import pytest

from app.web import upstream_pool
from app.web.upstream_pool import NoAnswer, UpstreamError, UpstreamPool
from tests.waiting import wait_until


class Server:
    """HTTP/1.1 on a socket: answers every request with its own head as the body;
    with `close`, closes the connection after each answer without saying so (as
    a server whose keep-alive timeout passed does); with `say_close`, answers
    `Connection: close`, reads nothing more, and closes a moment later (as a
    busy server does: the client must not wait for the close to see it)."""

    def __init__(self, close: bool = False, say_close: bool = False) -> None:
        self.close = close
        self.say_close = say_close
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
                extra = b"connection: close\r\n" if self.say_close else b""
                writer.write(
                    b"HTTP/1.1 200 OK\r\n%scontent-length: %d\r\n\r\n%s" % (extra, len(head), head)
                )
                await writer.drain()
                if self.say_close:
                    await asyncio.sleep(0.2)  # the server's own pace, not a wait of the test
                if self.close or self.say_close:
                    break
        except asyncio.IncompleteReadError:
            pass
        writer.close()
        await writer.wait_closed()
        self.closed += 1


@asynccontextmanager
async def serving(server: Any) -> AsyncIterator[str]:
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
                await wait_until(lambda i=i: server.closed > i, "the server to close it")
            await pool.aclose()

    asyncio.run(main())
    assert server.connections == 3


def test_a_connection_the_server_said_it_closes_is_not_reused() -> None:
    """`Connection: close` ends the connection at this answer, even while the
    socket is still open: a request sent on it would be lost when it closes."""
    server = Server(say_close=True)

    async def main() -> list[bytes]:
        async with serving(server) as base:
            pool = UpstreamPool(connect_timeout=5)
            try:
                return [await exchange(pool, f"{base}/x?n={i}") for i in range(2)]
            finally:
                await pool.aclose()

    answers = asyncio.run(main())
    assert server.connections == 2
    assert [a.split(b"\r\n")[0] for a in answers] == [
        b"POST /x?n=0 HTTP/1.1",
        b"POST /x?n=1 HTTP/1.1",
    ]


def test_a_connection_idle_past_the_keep_alive_is_not_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection idle longer than KEEPALIVE_S is closed, not reused (its
    server may be closing it that moment); one idle less is reused. The pool's
    clock is a fake one, so no test waits five seconds."""
    clock = [1000.0]
    monkeypatch.setattr(
        upstream_pool, "time", SimpleNamespace(monotonic=lambda: clock[0]), raising=True
    )
    server = Server()

    async def main() -> list[int]:
        async with serving(server) as base:
            pool = UpstreamPool(connect_timeout=5)
            seen = []
            try:
                for idle in (0.0, upstream_pool.KEEPALIVE_S - 0.1, upstream_pool.KEEPALIVE_S + 0.1):
                    clock[0] += idle
                    await exchange(pool, f"{base}/x")
                    seen.append(server.connections)
            finally:
                await pool.aclose()
            return seen

    assert asyncio.run(main()) == [1, 1, 2]


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


class Scripted:
    """A server that reads one request head (and `content-length` bytes) per
    answer and writes the next of `answers` as raw bytes, in the pieces given,
    a moment apart; then closes when `close_after` is set."""

    def __init__(self, *answers: list[bytes], close_after: bool = False) -> None:
        self.answers = list(answers)
        self.close_after = close_after
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.requests.append(head + await reader.readexactly(length))
                for piece in self.answers.pop(0):
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.01)  # so the pieces arrive apart
                if self.close_after:
                    break
        except asyncio.IncompleteReadError:
            pass
        writer.close()


async def answered(server: Scripted, method: str = "POST") -> tuple[int, list[bytes]]:
    async with serving(server) as base:
        pool = UpstreamPool(connect_timeout=5)
        response = await pool.send(method, f"{base}/x", [], b"{}" if method == "POST" else b"")
        try:
            return response.status_code, [chunk async for chunk in response.chunks()]
        finally:
            await response.aclose()
            await pool.aclose()


def test_a_chunked_answer_comes_piece_by_piece() -> None:
    server = Scripted(
        [
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
            b"6\r\ndata: \r\n",
            b"3\r\none\r\n",
            b"0\r\n\r\n",
        ]
    )
    status, chunks = asyncio.run(answered(server))
    assert status == 200 and chunks == [b"data: ", b"one"]


def test_a_body_without_length_ends_with_the_connection() -> None:
    server = Scripted([b"HTTP/1.1 200 OK\r\n\r\n", b"until ", b"closed"], close_after=True)
    assert b"".join(asyncio.run(answered(server))[1]) == b"until closed"


def test_a_head_answer_has_no_body_whatever_its_length_says() -> None:
    server = Scripted([b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n"])
    assert asyncio.run(answered(server, "HEAD")) == (200, [])


def test_a_100_continue_before_the_answer_is_skipped() -> None:
    server = Scripted(
        [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok"]
    )
    assert asyncio.run(answered(server)) == (201, [b"ok"])


def test_a_server_that_closes_without_answering_is_no_answer() -> None:
    server = Scripted([], close_after=True)
    server.answers = [[]]  # reads the request, answers nothing, closes
    with pytest.raises(NoAnswer) as raised:
        asyncio.run(answered(server))
    assert "without sending a response" in str(raised.value)


def test_an_answer_cut_short_is_an_upstream_error_and_the_connection_is_dropped() -> None:
    server = Scripted(
        [b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n", b"only part"], close_after=True
    )
    with pytest.raises(UpstreamError) as raised:
        asyncio.run(answered(server))
    assert "complete message body" in str(raised.value)


def test_garbage_instead_of_an_answer_is_a_protocol_error() -> None:
    server = Scripted([b"SSH-2.0-OpenSSH\r\n\r\n"])
    with pytest.raises(UpstreamError) as raised:
        asyncio.run(answered(server))
    assert "invalid HTTP response" in str(raised.value)


def test_an_answer_not_read_to_its_end_is_not_reused() -> None:
    server = Scripted(
        [b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n", b"ab", b"cd"],
        [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"],
    )

    async def main() -> bytes:
        async with serving(server) as base:
            pool = UpstreamPool(connect_timeout=5)
            first = await pool.send("POST", f"{base}/x", [], b"{}")
            await first.aclose()  # the body left unread
            second = await pool.send("POST", f"{base}/x", [], b"{}")
            body = b"".join([chunk async for chunk in second.chunks()])
            await second.aclose()
            await pool.aclose()
            return body

    assert asyncio.run(main()) == b"ok"
    assert server.connections == 2


def test_a_target_with_whitespace_is_refused_before_anything_is_sent() -> None:
    server = Scripted([b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"])

    async def main() -> None:
        async with serving(server) as base:
            pool = UpstreamPool(connect_timeout=5)
            try:
                await pool.send("POST", f"{base}/a b", [], b"{}")
            finally:
                await pool.aclose()

    with pytest.raises(UpstreamError):
        asyncio.run(main())
    assert server.requests == []
