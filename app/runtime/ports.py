"""The run loop's ports other than processes (app/runtime/processes.py): the
event log it writes and the timers it arms. The event stores implement
`EventSink` (SQLite in production, in memory in tests); the event loop is the
`Timers`, a fake clock in unit tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from app.core import events as ev


class EventSink(Protocol):
    failure: str | None
    retry_in: float

    def submit(self, events: list[ev.AnyEvent]) -> asyncio.Future[list[int]]: ...
    def on_change(self, listener: Callable[[], None]) -> None: ...


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Timers(Protocol):
    """`call_later` as the event loop has it; a fake clock in unit tests."""

    def call_later(
        self, delay: float, callback: Callable[..., object], *args: Any
    ) -> Cancellable: ...


async def first_of(timers: Timers, fut: asyncio.Future[Any], seconds: float) -> None:
    """Wait until `fut` is done or `seconds` pass on `timers` (a fake clock in
    unit tests); `fut` is left as it is."""
    if seconds <= 0 or fut.done():
        return
    timer: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def ring() -> None:
        if not timer.done():
            timer.set_result(None)

    handle = timers.call_later(seconds, ring)
    try:
        await asyncio.wait({fut, timer}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        handle.cancel()
