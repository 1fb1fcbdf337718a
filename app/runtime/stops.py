"""What a stop does to the requests running on a model: an operator's unload,
a graceful drain, and a durable job put back in the queue sent again (a part
of `Scheduler`, app/runtime/scheduler.py; what each request's fate is, the
core says: `app.core.drain`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from app.core import events as ev
from app.core.drain import Fate, after_grace, cancelled_at_stop
from app.core.state import SchedulerState
from app.runtime.api import SHUTTING_DOWN, Detached, Ticket
from app.runtime.ports import Timers, first_of
from app.runtime.processes import Processes
from app.runtime.swaps import Swaps

log = logging.getLogger("gpulane.scheduler")


class Stops:
    """Unload and drain (mixed into `Scheduler`)."""

    state: SchedulerState
    clock: Callable[[], int]
    processes: Processes
    swaps: Swaps
    tickets: dict[str, Ticket]
    draining: bool
    _timers: Timers
    _idle: asyncio.Future[None] | None
    _send_again: Callable[[Ticket, Any], None] | None

    if TYPE_CHECKING:

        def emit(self, events: Any) -> asyncio.Future[list[int]]:
            raise NotImplementedError

        def _end(self, event: ev.AnyEvent, detach: Detached | None = None) -> bool:
            raise NotImplementedError

        def _detach(self, request_id: str, detach: Detached | None) -> None:
            raise NotImplementedError

    async def unload(self, model: str | None) -> list[str]:
        """An operator unloads one model or every one (llama-swap's unload):
        each of its processes stops now, busy or not, and this returns once they
        have stopped. What runs on it ends as at the end of a drain's grace
        (`drain.after_grace`: a durable job is re-queued, a synchronous request
        fails with 503); what waits stays queued and loads it again in its turn."""
        # Said on arrival: an unload waits out a sleep under way, and records nothing till then.
        log.info("unload of %s asked by an operator", "every model" if model is None else model)
        loaded = self.processes.models() + self.swaps.sleepers.models()  # asleep too
        targets = [m for m in loaded if model is None or m == model]
        for name in targets:
            self.swaps.stop(name, "unload")
        for name in targets:
            why = f"model {name!r} was unloaded by an operator before the request finished"
            self._cut_off(after_grace(self.state, name), why, Detached(503, "model_unloaded", why))
        # A model put to sleep meanwhile is stopped once its sleep ends, as at shutdown.
        late = await self.swaps.stops_ended("unload", model)
        return targets + [m for m in late if m not in targets]

    async def drain(self, grace: float) -> None:
        """Graceful stop: admit nothing more and dispatch nothing more; waiting
        synchronous clients get 503; running work may finish within `grace`
        seconds. What still runs then: a durable job goes back in the queue on
        the same attempt (a stop is not the job's fault), a synchronous request
        fails. Durable jobs that wait stay queued in the log for the next start."""
        self.draining = True
        detach = Detached(503, "shutting_down", SHUTTING_DOWN)
        for request_id in cancelled_at_stop(self.state):
            self._end(
                ev.RequestCancelled(at=self.clock(), request_id=request_id, reason="shutdown"),
                detach,
            )
        if self.state.running:
            self._idle = asyncio.get_running_loop().create_future()
            await first_of(self._timers, self._idle, grace)
        self._cut_off(
            after_grace(self.state),
            f"gpulane stopped before the request finished (shutdownGrace {grace:g} s)",
            detach,
        )

    def on_put_back(self, send: Callable[[Ticket, Any], None]) -> None:
        """`send(ticket, job)` sends a durable job again on a fresh ticket when
        its server stops under it and it goes back in the queue (an unload): the
        jobs layer registers `Jobs.run` (imports go web -> jobs -> runtime)."""
        self._send_again = send

    def _cut_off(self, fates: list[tuple[str, Fate]], why: str, detach: Detached) -> None:
        """End (`why`) or re-queue running requests whose server stops under them."""
        for request_id, fate in fates:
            if fate == "requeue":
                attempt = self.state.requests[request_id].attempt
                ticket = self.tickets.get(request_id)
                self.emit(
                    [ev.RequestRequeued(at=self.clock(), request_id=request_id, attempt=attempt)]
                )
                self._detach(request_id, detach)
                if not self.draining:  # a drain's requeue runs at the next start
                    self._send_fresh(request_id, ticket)
            else:
                self._end(
                    ev.RequestFailed(
                        at=self.clock(), request_id=request_id, error=why, http_status=503
                    ),
                    detach,
                )

    def _send_fresh(self, request_id: str, old: Ticket | None) -> None:
        """A job put back in the queue while it ran: its serving task has been
        told to stop (`old.detached`), so a fresh ticket, sent by the jobs layer
        when its turn comes again. Without anyone to send it, its next dispatch
        would hold the lane forever: it fails instead."""
        job = None if old is None else old.job
        if old is None or job is None or self._send_again is None:
            self._no_sender(request_id, "was put back in the queue")
            return
        fresh = Ticket(request_id, old.model, old.priority, old.enqueued_ns, old.endpoint)
        self.tickets[request_id] = fresh
        self._send_again(fresh, job)

    def _no_sender(self, request_id: str, what: str) -> None:
        """A request that nobody would send upstream: a defect, logged and ended
        as the request's failure rather than left holding its lane."""
        message = (
            f"internal error: request {request_id} {what} with nothing to send it "
            "upstream; failed rather than left holding its lane"
        )
        log.error("%s", message)
        self._end(
            ev.RequestFailed(at=self.clock(), request_id=request_id, error=message, http_status=500)
        )
