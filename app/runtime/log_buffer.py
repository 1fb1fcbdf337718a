"""Recent log lines kept in memory, for GET /logs and GET /logs/stream."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass
from types import TracebackType


@dataclass(frozen=True, slots=True)
class LogLine:
    source: str  # "proxy" or "upstream:MODEL"
    text: str
    time: float  # unix seconds

    def format(self) -> str:
        return f"[{self.source}] {self.text}"


class LogBuffer:
    """A ring buffer of the last ``max_lines`` lines, with live subscribers."""

    def __init__(self, max_lines: int = 10_000) -> None:
        self._lines: deque[LogLine] = deque(maxlen=max_lines)
        self._subscribers: set[LogSubscription] = set()
        # Logging handlers may append from other threads than the event loop's.
        self._lock = threading.Lock()

    def append(self, source: str, line: str) -> None:
        """Add a line (text holding newlines becomes several lines)."""
        now = time.time()
        with self._lock:
            for text in line.rstrip("\r\n").split("\n"):
                entry = LogLine(source, text.rstrip("\r"), now)
                self._lines.append(entry)
                for subscriber in self._subscribers:
                    subscriber._deliver(entry)

    def lines(self, source: str | None = None) -> list[LogLine]:
        with self._lock:
            return [line for line in self._lines if source is None or line.source == source]

    def text(self, source: str | None = None) -> str:
        return "".join(line.format() + "\n" for line in self.lines(source))

    def __len__(self) -> int:
        return len(self._lines)

    def subscribe(self, maxsize: int = 1000, backlog: int = 0) -> LogSubscription:
        """New lines from now on, after up to ``backlog`` recent ones.

        Must be called on the event loop that will read it. A reader that falls
        more than ``maxsize`` lines behind loses the oldest queued lines (counted
        in ``dropped``); the writer never waits. Close it, or use ``async with``.
        """
        subscription = LogSubscription(self, maxsize)
        with self._lock:
            for entry in list(self._lines)[-backlog:] if backlog > 0 else []:
                subscription._deliver(entry)
            self._subscribers.add(subscription)
        return subscription

    def _unsubscribe(self, subscription: LogSubscription) -> None:
        with self._lock:
            self._subscribers.discard(subscription)


class LogSubscription:
    """One live reader's bounded queue; iterate with ``async for``."""

    def __init__(self, buffer: LogBuffer, maxsize: int) -> None:
        self._buffer = buffer
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[LogLine | None] = asyncio.Queue(max(1, maxsize))
        self._closed = False
        self.dropped = 0

    def _deliver(self, entry: LogLine | None) -> None:
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._offer(entry)
        else:
            try:
                self._loop.call_soon_threadsafe(self._offer, entry)
            except RuntimeError:
                pass  # the reader's loop is closed; nobody is listening

    def _offer(self, entry: LogLine | None) -> None:
        if self._closed and entry is not None:
            return
        if self._queue.full():
            self._queue.get_nowait()  # drop the oldest: a live tail wants the newest
            self.dropped += 1
        self._queue.put_nowait(entry)

    async def get(self) -> LogLine | None:
        """The next line, or None once closed."""
        if self._closed and self._queue.empty():
            return None
        return await self._queue.get()

    def close(self) -> None:
        if self._closed:
            return
        self._buffer._unsubscribe(self)
        self._closed = True
        self._deliver(None)  # wakes a reader blocked in get()

    def __aiter__(self) -> LogSubscription:
        return self

    async def __anext__(self) -> LogLine:
        entry = await self.get()
        if entry is None:
            raise StopAsyncIteration
        return entry

    async def __aenter__(self) -> LogSubscription:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
