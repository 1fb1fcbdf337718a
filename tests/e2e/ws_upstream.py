"""A model server that speaks websockets, for tests/e2e/test_websockets.py:

    python -m tests.e2e.ws_upstream --port N

`GET /health` answers 200. A socket on any path first gets a JSON hello (the
path and query it reached, the subprotocol chosen, the `x-test` header), then
every message back as it came (text as text, bytes as bytes); the text
`close CODE` makes it close with that code. `/refuse` is refused with 403.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from http import HTTPStatus

from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response


def answer_plain_http(connection: ServerConnection, request: Request) -> Response | None:
    path = request.path.split("?", 1)[0]
    if path == "/health":
        return connection.respond(HTTPStatus.OK, "OK\n")
    if path == "/refuse":
        return connection.respond(HTTPStatus.FORBIDDEN, "refused by the upstream\n")
    return None


async def echo(connection: ServerConnection) -> None:
    request = connection.request
    assert request is not None
    hello = {
        "path": request.path,
        "subprotocol": connection.subprotocol,
        "x-test": request.headers.get("x-test"),
    }
    await connection.send(json.dumps(hello))
    async for message in connection:
        if isinstance(message, str) and message.startswith("close "):
            await connection.close(int(message.split()[1]), "asked to")
            return
        await connection.send(message)


async def main(port: int) -> None:
    stop = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set_result, None)
    async with serve(
        echo,
        "127.0.0.1",
        port,
        process_request=answer_plain_http,
        select_subprotocol=lambda connection, offered: "chat" if "chat" in offered else None,
    ):
        await stop


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(main(parser.parse_args().port))
