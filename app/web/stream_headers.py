"""`X-Accel-Buffering: no` on every event stream, as llama-swap sets it on
proxied `text/event-stream` answers, its log streams and `/api/events`: nginx
in front of gpulane otherwise holds the events back until its buffer fills."""

from __future__ import annotations

from litestar.types import Message, Scope

_NAME = b"x-accel-buffering"


async def no_proxy_buffering(message: Message, scope: Scope) -> None:
    """Litestar `before_send` hook: proxied, progress, job and log streams alike."""
    if message["type"] != "http.response.start":
        return
    headers = list(message.get("headers") or [])
    names = {bytes(name).lower() for name, _ in headers}
    if _NAME in names:
        return
    if any(
        bytes(name).lower() == b"content-type"
        and bytes(value).lower().startswith(b"text/event-stream")
        for name, value in headers
    ):
        headers.append((_NAME, b"no"))
        message["headers"] = headers
