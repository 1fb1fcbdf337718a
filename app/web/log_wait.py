"""What `gpulane serve` answers while its event log cannot be opened for want of disk.

A server whose disk fills up while it runs keeps serving what it can: nothing
new is admitted (503 `event_log_unavailable`, with Retry-After), `/health`
says why, and it goes on once the disk accepts writes again. A server started
on a full disk (it cannot open the log, or cannot take the lease) does the
same instead of exiting: it listens at once, answers `/health` with 503 and a
text that starts `event log cannot be opened` and says why, every other
request with 503 `event_log_unavailable` and `Retry-After`, tries again every
`RETRY_S`, and once the log opens and the lease is taken, serve starts as
usual on the same listening socket (a connection made meanwhile waits in its
backlog, never refused).

Only the disk refusing writes is waited for (`refused_by_disk`); a damaged,
locked or read-only database still stops the start with its message.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

from app.store.engine import DatabaseError, database_url, refused_by_disk
from app.web.errors import retry_after, send_error, send_websocket_error

log = logging.getLogger("gpulane")

RETRY_S = 1.0
"""Seconds between tries to open the log (the running server's own writer
tries again within seconds too)."""

_NEARLY_FULL = 1 << 20
"""Free bytes under which the disk is called full in the text."""

T = TypeVar("T")


class LogWait:
    """ASGI: the answers of a server waiting for its event log (`why` it cannot open it)."""

    def __init__(self, db: str, why: DatabaseError) -> None:
        self.db = db
        self.why = why

    def text(self) -> str:
        return (
            f"event log cannot be opened: {self.why}{_free_note(self.db)}; trying again "
            f"every {RETRY_S:g} s, serving once it can"
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        text = self.text()
        wait = retry_after(max(1, round(RETRY_S)))
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send_websocket_error(
                scope, send, 503, text, code="event_log_unavailable", headers=wait
            )
        elif scope["type"] == "http":
            if scope["path"] == "/health":
                body = text.encode()
                head = [
                    (b"content-type", b"text/plain; charset=utf-8"),
                    (b"content-length", str(len(body)).encode()),
                    *wait,
                ]
                await send({"type": "http.response.start", "status": 503, "headers": head})
                await send({"type": "http.response.body", "body": body, "more_body": False})
            else:
                await send_error(send, 503, text, code="event_log_unavailable", headers=wait)


async def open_when_disk_allows(
    gate: LogWait, open_log: Callable[[], T], stop: Callable[[], None]
) -> T:
    """Try `open_log` every RETRY_S until it returns what it opened; a refusal
    by the disk is kept in `gate` and logged when its reason changes; any other
    error is raised. Either way the waiting server is told to `stop`."""
    last = str(gate.why)
    try:
        while True:
            await asyncio.sleep(RETRY_S)
            try:
                opened = await asyncio.to_thread(open_log)
            except DatabaseError as exc:
                if not refused_by_disk(exc):
                    raise
                gate.why = exc
                if str(exc) != last:
                    last = str(exc)
                    log.warning("%s", gate.text())
                continue
            log.info("event log opened: starting")
            return opened
    finally:
        stop()


def _free_note(db: str) -> str:
    """What is free on an SQLite file's disk, for the text; '' for a server database."""
    try:
        url = database_url(db)
    except DatabaseError:
        return ""
    if url.get_backend_name() != "sqlite" or not url.database:
        return ""
    directory = os.path.dirname(os.path.abspath(url.database))
    try:
        stat = os.statvfs(directory)
    except OSError:
        return ""
    free = stat.f_bavail * stat.f_frsize
    full = "the disk is full: " if free < _NEARLY_FULL else ""
    return f" ({full}{directory} has {free} bytes free)"
