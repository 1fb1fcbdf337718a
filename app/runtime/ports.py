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
