"""The event store port: what the runtime needs from a log, whatever holds it.

`SqlEventStore` (SQLite or PostgreSQL) is the real one, `InMemoryEventStore` the stand-in for unit
tests; tests/integration/test_event_store.py is the contract both pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Protocol

from app.core.events import AnyEvent


class StoreError(Exception):
    """Events could not be stored (the transaction failed, or the store is closed)."""


class EventStore(Protocol):
    failure: str | None
    """Why the database refuses writes, None once a write succeeds. While set, the
    refused events are kept and retried in order; the server admits and starts
    nothing new."""
    retry_in: float
    """Seconds until the next try while `failure` is set."""

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener` whenever `failure` is set or cleared."""

    def start(self) -> None:
        """Begin accepting events; call from inside the running event loop."""

    def submit(self, events: Sequence[AnyEvent]) -> asyncio.Future[list[int]]:
        """Queue events without waiting; the future resolves to their seqs once committed.

        Events keep the order of the calls. While the database refuses writes the
        future stays pending (the events are retried); it fails with StoreError
        only for an event that cannot be stored at all, or at a `close` that
        gave up on a refusing database.
        """
        ...

    async def append(self, events: Sequence[AnyEvent]) -> list[int]:
        """Store events and wait until they are committed (durable work uses this)."""
        ...

    async def close(self) -> None:
        """Commit everything submitted so far, then refuse new events."""

    def read(
        self, after_seq: int = 0, limit: int | None = None, request_id: str | None = None
    ) -> list[tuple[int, AnyEvent]]:
        """Committed events with seq > after_seq, in seq order."""
        ...
