"""An in-memory event store with the SQLite store's async contract, for fast unit tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from app.core.events import AnyEvent, decode, encode, request_id_of
from app.store.port import StoreError


class InMemoryEventStore:
    """Keeps `(seq, event)` pairs in a list; every submit commits at once."""

    def __init__(self) -> None:
        self.failure: str | None = None
        self.retry_in = 0.0
        self.events: list[tuple[int, AnyEvent]] = []
        self.listeners: list[Callable[[], None]] = []
        self._state = "new"

    def on_change(self, listener: Callable[[], None]) -> None:
        self.listeners.append(listener)

    def start(self) -> None:
        self._state = "open"

    def submit(self, events: Sequence[AnyEvent]) -> asyncio.Future[list[int]]:
        if self._state != "open":
            raise StoreError(f"event store is {self._state}, not open")
        first = len(self.events) + 1
        # A round trip through the wire format, so tests see what SQLite would return.
        self.events.extend((first + i, decode(encode(e))) for i, e in enumerate(events))
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        future.set_result(list(range(first, first + len(events))))
        return future

    async def append(self, events: Sequence[AnyEvent]) -> list[int]:
        return await self.submit(events)

    async def close(self) -> None:
        self._state = "closed"

    def read(
        self, after_seq: int = 0, limit: int | None = None, request_id: str | None = None
    ) -> list[tuple[int, AnyEvent]]:
        found = [
            (seq, e)
            for seq, e in self.events[after_seq:]
            if request_id is None or request_id_of(e) == request_id
        ]
        return found if limit is None else found[:limit]
