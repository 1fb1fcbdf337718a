"""Stand-ins for the run loop's ports, so tests/unit/test_scheduler.py drives the
real `Scheduler` with no processes, no sockets and no waiting on the wall clock.

- `FakeClock`: unix ns that move only in `advance`, which also fires the
  `call_later` timers (TTLs, maxRunTime) that fall due, in order.
- `FakeUpstreams`: the upstream factory. Each `FakeUpstream` records its start
  and stop in `calls`; its start completes when the test says (`load`, `fail`)
  or at once (`auto_load`); `crash` makes it exit on its own.
- `HeldStore`: the in-memory event store, with commits that wait for the test
  (`hold`, then `release` or `fail`), for durable admission.
- `Lane`: a scheduler wired to these, and the facts the web layer would report.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any

from app.config import ModelConfig, parse_config
from app.core import events as ev
from app.runtime.api import Admission, Ticket
from app.runtime.log_buffer import LogBuffer
from app.runtime.processes import Upstream
from app.runtime.scheduler import Scheduler
from app.runtime.upstream import UpstreamStartError
from app.store.memory_store import InMemoryEventStore
from app.store.port import StoreError

T0_NS = 1_700_000_000 * 10**9
"""Where every fake clock starts (unix ns), so event times read like real ones."""


async def settle() -> None:
    """Run the event loop until every task the scheduler started waits on
    something the test controls: nothing is left ready to run (asyncio's ready
    queue is empty). Nothing here does I/O or uses the wall clock, so that is
    the state in which a test may look; a loop that never gets there spins."""
    loop = asyncio.get_running_loop()
    for _ in range(100_000):
        await asyncio.sleep(0)
        if not loop._ready:  # type: ignore[attr-defined]
            return
    raise AssertionError("the event loop never went idle: some task spins")


class FakeTimer:
    __slots__ = ("due_ns", "callback", "args", "cancelled")

    def __init__(self, due_ns: int, callback: Callable[..., object], args: tuple[Any, ...]):
        self.due_ns = due_ns
        self.callback = callback
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """The scheduler's `clock` and `timers` in one."""

    def __init__(self, start_ns: int = T0_NS) -> None:
        self.now_ns = start_ns
        self._heap: list[tuple[int, int, FakeTimer]] = []
        self._order = itertools.count()

    def __call__(self) -> int:
        return self.now_ns

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> FakeTimer:
        timer = FakeTimer(self.now_ns + round(delay * 1e9), callback, args)
        heapq.heappush(self._heap, (timer.due_ns, next(self._order), timer))
        return timer

    def pending(self) -> list[FakeTimer]:
        """Timers armed and not cancelled, soonest first."""
        return [t for _, _, t in sorted(self._heap) if not t.cancelled]

    async def advance(self, seconds: float) -> None:
        """Move time forward, firing each timer that falls due at its own instant
        (timers armed by a callback fire too if they fall due in the window)."""
        end = self.now_ns + round(seconds * 1e9)
        await settle()
        while self._heap and self._heap[0][0] <= end:
            due, _, timer = heapq.heappop(self._heap)
            if timer.cancelled:
                continue
            self.now_ns = max(self.now_ns, due)
            timer.callback(*timer.args)
            await settle()
        self.now_ns = end
        await settle()


class FakeUpstream:
    """One model server as the run loop sees it: `Upstream` in scheduler.py."""

    def __init__(
        self,
        spec: ModelConfig,
        on_spawn: Callable[[Upstream], None],
        owner: FakeUpstreams,
    ) -> None:
        self.spec = spec
        self.pid: int | None = None
        self.cmdline = list(spec.cmd)
        self.stopping = False
        self.out_of_memory: str | None = None
        """What a real server's output would say of running out of GPU memory."""
        self._on_spawn = on_spawn
        self._owner = owner
        loop = asyncio.get_running_loop()
        self._loaded: asyncio.Future[None] = loop.create_future()
        self._exit: asyncio.Future[int] = loop.create_future()

    @property
    def model(self) -> str:
        return self.spec.id

    @property
    def running(self) -> bool:
        """Spawned and not exited (loading included), as for a real process."""
        return self.pid is not None and not self._exit.done()

    @property
    def exit_code(self) -> int | None:
        return self._exit.result() if self._exit.done() else None

    @property
    def loading(self) -> bool:
        return self.pid is not None and not self._loaded.done()

    async def start(self) -> int:
        self._owner.calls.append(("start", self.model))
        refused = self._owner.refuse.get(self.model)
        if refused is not None:  # before anything is spawned (a port in use)
            raise UpstreamStartError(refused, model_id=self.model)
        self.pid = next(self._owner.pids)
        self._on_spawn(self)
        if self._owner.auto_load:
            self.load()
        # As a real health wait does, race the load against an exit.
        either: set[asyncio.Future[Any]] = {self._loaded, self._exit}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not self._loaded.done():
            reason = f"exited with code {self._exit.result()} during start"
            raise UpstreamStartError(reason, model_id=self.model)
        error = self._loaded.exception()
        if error is not None:
            # A real upstream stops what it spawned before it raises.
            if not self._exit.done():
                self._exit.set_result(1)
            raise error
        return self.pid

    async def stop(self) -> int | None:
        self._owner.calls.append(("stop", self.model))
        if self.pid is None:
            return None
        self.stopping = True
        await self._owner.stops_released.wait()
        if not self._exit.done():
            self._exit.set_result(-15)
        return self.exit_code

    async def wait_exit(self) -> int:
        return await asyncio.shield(self._exit)

    # -- what the test makes happen ---------------------------------------------

    def load(self) -> None:
        """The health check answered: start() returns."""
        if not self._loaded.done():
            self._loaded.set_result(None)

    def fail(self, reason: str = "exited with code 3 during start") -> None:
        """The start failed after the process was spawned."""
        self._loaded.set_exception(UpstreamStartError(reason, model_id=self.model, exit_code=3))

    def crash(self, code: int = 137) -> None:
        """The process exits by itself."""
        self._exit.set_result(code)


class FakeUpstreams:
    """The `upstreams` factory; `calls` is every start and stop, in order."""

    def __init__(self, *, auto_load: bool = True) -> None:
        self.auto_load = auto_load
        self.made: list[FakeUpstream] = []
        self.calls: list[tuple[str, str]] = []
        self.pids = itertools.count(4000)
        self.refuse: dict[str, str] = {}
        """model -> why its next starts are refused before spawning anything."""
        self.stops_released = asyncio.Event()
        self.stops_released.set()

    def hold_stops(self) -> None:
        """Stops hang (a model slow to free the GPU) until `release_stops`."""
        self.stops_released.clear()

    def release_stops(self) -> None:
        self.stops_released.set()

    def __call__(self, spec: ModelConfig, on_spawn: Callable[[Upstream], None]) -> FakeUpstream:
        upstream = FakeUpstream(spec, on_spawn, self)
        self.made.append(upstream)
        return upstream

    def last(self, model: str) -> FakeUpstream:
        return [u for u in self.made if u.model == model][-1]


class HeldStore(InMemoryEventStore):
    """Commits at once, or, after `hold()`, only when the test says."""

    def __init__(self) -> None:
        super().__init__()
        self._held: list[tuple[list[ev.AnyEvent], asyncio.Future[list[int]]]] | None = None

    def hold(self) -> None:
        self._held = []

    def submit(self, events: Sequence[ev.AnyEvent]) -> asyncio.Future[list[int]]:
        if self._held is None:
            return super().submit(events)
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._held.append((list(events), future))
        return future

    def release(self) -> None:
        """Commit everything held, in order, and commit at once from now on."""
        held, self._held = self._held or [], None
        for events, future in held:
            future.set_result(super().submit(events).result())

    def fail(self, message: str = "disk I/O error") -> None:
        """Every held batch fails to commit, and nothing is kept."""
        held, self._held = self._held or [], None
        for _, future in held:
            future.set_exception(StoreError(message))


def config_text(
    models: dict[str, dict[str, Any]],
    scheduler: str = "serial",
    *,
    router: dict[str, Any] | None = None,
    **settings: Any,
) -> str:
    """A config file (JSON is YAML) with these models (extra keys in camelCase),
    the scheduler's settings (`swapAffinityBonus=0`, `priority={...}`) and
    `routing.router` (`{"use": "group", "settings": {"groups": ...}}`)."""
    entries = {
        name: {"cmd": f"fake-server --name {name} --port ${{PORT}}"} | keys
        for name, keys in models.items()
    }
    routing: dict[str, Any] = {"scheduler": {"use": scheduler, "settings": {scheduler: settings}}}
    if router is not None:
        routing["router"] = router
    return json.dumps({"routing": routing, "models": entries})


class Lane:
    """A real `Scheduler` on fake ports, and the facts the web layer reports."""

    def __init__(
        self,
        config: str,
        *,
        auto_load: bool = True,
        store: InMemoryEventStore | None = None,
    ) -> None:
        self.config = parse_config(config)
        self.clock = FakeClock()
        self.upstreams = FakeUpstreams(auto_load=auto_load)
        self.store = store if store is not None else InMemoryEventStore()
        self.store.start()
        self.scheduler = Scheduler(
            self.config,
            self.store,
            logs=LogBuffer(),
            clock=self.clock,
            timers=self.clock,
            upstreams=self.upstreams,
        )

    def admit(
        self, model: str, priority: int = 0, *, durable: bool = False, endpoint: str = "/v1/chat"
    ) -> Ticket:
        return self.scheduler.admit(
            Admission(
                model=model,
                model_requested=model,
                endpoint=endpoint,
                priority=priority,
                durable=durable,
            )
        )

    # -- what was recorded ---------------------------------------------------------

    def events(self, *kinds: type[ev.AnyEvent]) -> list[Any]:
        """Recorded events, oldest first: all, or those of the given classes."""
        found = [e for _, e in self.store.events]
        return [e for e in found if not kinds or isinstance(e, kinds)]

    def types(self, *ignore: type[ev.AnyEvent]) -> list[str]:
        return [ev.type_name(e) for e in self.events() if not isinstance(e, ignore)]

    def dispatched(self) -> list[str]:
        """Request ids in dispatch order."""
        return [e.request_id for e in self.events(ev.RequestDispatched)]

    def order(self, tickets: Sequence[Ticket]) -> list[int]:
        """Indexes into `tickets`, in the order they were dispatched."""
        ids = [t.request_id for t in tickets]
        return [ids.index(rid) for rid in self.dispatched() if rid in ids]

    def ended(self, ticket: Ticket) -> Any:
        """The request's one terminal event (asserts there is exactly one)."""
        terminal = (ev.RequestCompleted, ev.RequestFailed, ev.RequestCancelled)
        found = [e for e in self.events(*terminal) if e.request_id == ticket.request_id]
        assert len(found) == 1, found
        return found[0]

    # -- facts ---------------------------------------------------------------------

    async def finish(self, ticket: Ticket, status: int = 200) -> None:
        """The ticket's request ran to the end: started, then completed."""
        await settle()
        assert ticket.ready.done() and not ticket.ready.cancelled(), ticket.request_id
        assert ticket.ready.exception() is None, ticket.ready.exception()
        self.scheduler.started(ticket.request_id)
        self.scheduler.completed(ticket.request_id, status)
        await settle()

    async def serve_all(self) -> None:
        """Complete whatever is dispatched and ready, until nothing is open."""
        await settle()
        while self.scheduler.state.requests:
            ready = [
                t
                for t in self.scheduler.tickets.values()
                if t.ready.done() and not t.ready.cancelled() and t.ready.exception() is None
            ]
            assert ready, f"open but not ready: {list(self.scheduler.state.requests)}"
            for ticket in ready:
                await self.finish(ticket)
