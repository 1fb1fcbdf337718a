"""OpenAI-style error envelope: {"error": {"message", "type", "code"}}."""

from __future__ import annotations

import msgspec
from litestar.types import Send

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    502: "upstream_error",
    503: "service_unavailable",
}


def error_body(status: int, message: str, code: str | None = None) -> bytes:
    kind = _TYPES.get(status, "server_error")
    return msgspec.json.encode({"error": {"message": message, "type": kind, "code": code or kind}})


async def send_error(
    send: Send,
    status: int,
    message: str,
    *,
    code: str | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    await send_json(send, status, error_body(status, message, code), headers)


async def send_json(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """A whole JSON response on a raw ASGI `send`."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
