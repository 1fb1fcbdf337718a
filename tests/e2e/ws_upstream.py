"""A model server that speaks websockets, for tests/e2e/test_websockets.py:

    python -m tests.e2e.ws_upstream --port N

`GET /health` answers 200. A socket on any path first gets a JSON hello (the
path and query it reached, the subprotocol chosen, the `x-test` header), then
every message back as it came (text as text, bytes as bytes); the text
`close CODE` makes it close with that code. `/refuse` is refused with 403.
`GET /closed` answers, as JSON, the close code and reason each socket that the
client closed sent it, by the path and query it reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from http import HTTPStatus
from typing import Any

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

CLOSED: dict[str, dict[str, Any]] = {}
"""Path and query -> the close frame its client sent."""


def answer_plain_http(connection: ServerConnection, request: Request) -> Response | None:
    path = request.path.split("?", 1)[0]
    if path == "/health":
        return connection.respond(HTTPStatus.OK, "OK\n")
    if path == "/closed":
        return connection.respond(HTTPStatus.OK, json.dumps(CLOSED))
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
    try:
        async for message in connection:
            if isinstance(message, str) and message.startswith("close "):
                await connection.close(int(message.split()[1]), "asked to")
                return
            await connection.send(message)
    except ConnectionClosed:  # iterating raises for a close code other than 1000 and 1001
        pass
    finally:
        received = connection.protocol.close_rcvd  # the client closed: what it said
        if received is not None:
            CLOSED[request.path] = {"code": received.code, "reason": received.reason}


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
