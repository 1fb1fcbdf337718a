"""What a standby answers (`gpulane serve --standby` while another gpulane leads).

The gate stands in front of the whole application until this process leads:
`/health` is 503 with a text that starts `standby` and names the leader (a
load balancer's health check sends traffic to the leader only); every other
request is 503 `standby` in the OpenAI error shape, with `Retry-After` (the
seconds until the leader's lease lapses unless it renews: the earliest this
one can take over). Once serve has recovered as the new leader it opens the
gate, and every request goes to the application as on any leader.
"""

from __future__ import annotations

from typing import Any

from litestar.types import ASGIApp, Send

from app.runtime.leadership import Leadership
from app.store.lease import host_name
from app.web.errors import retry_after, send_error, send_websocket_error


def standby_text(leadership: Leadership) -> str:
    """`standby: ...`: who leads, where to send requests, when this one may take over."""
    row = leadership.leader
    if row is None:
        return "standby: taking over the server lease"
    here = " (this host)" if row.host == host_name() else ""
    return (
        f"standby: the leader is pid {row.pid} on host {row.host}{here}, listening on "
        f"{row.listen} (lease term {row.term}); send requests there. This gpulane "
        f"takes over if that lease lapses (in {leadership.retry_after()} s unless renewed)"
    )


class StandbyGate:
    """ASGI: the application once `open`, the standby's answers before."""

    def __init__(self, leadership: Leadership) -> None:
        self.leadership = leadership
        self.app: ASGIApp | None = None
        """The application (serve sets it)."""
        self.open = False
        """Set by serve once this process leads and has recovered."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.app is not None and (self.open or scope["type"] == "lifespan"):
            await self.app(scope, receive, send)
            return
        text = standby_text(self.leadership)
        wait = retry_after(self.leadership.retry_after())
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send_websocket_error(scope, send, 503, text, code="standby", headers=wait)
        elif scope["type"] == "http":
            if scope["path"] == "/health":
                await _send_text(send, 503, text, wait)
            else:
                await send_error(send, 503, text, code="standby", headers=wait)


async def _send_text(
    send: Send, status: int, text: str, headers: list[tuple[bytes, bytes]]
) -> None:
    body = text.encode()
    head: list[Any] = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})
