"""The run loop: owns the scheduler state, calls the pure core, records, acts.

Every public method but a few is synchronous and never awaits, so each one runs
to the end on the event loop before anything else touches the state: these
calls are the messages, the event loop is the mailbox, and no lock is needed.
The async ones (`reload_crashed`, `drain`, `shutdown`) read the
state again after each await and change it only in the synchronous stretches
between. Slow work (loading a model, stopping one, proxying a response) runs in
tasks that report facts back by calling these methods; the scheduler builds the
events.

The scheduler owns a request from admission to its one terminal event. The task
serving a request is supervised: if it ends while the request is still open,
whatever happened becomes the request's recorded failure. A run past its
model's `maxRunTime` is failed and its upstream restarted; an operator can
cancel a running request. Either way the serving task is told through
`Ticket.detached` and the lane moves on at once, whether or not the upstream
answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from app.config import Config
from app.core import events as ev
from app.core.lane_history import LaneHistory
from app.core.policy import decide
from app.core.priority import band_of
from app.core.reload import plan_reload
from app.core.run_estimate import RunEstimates
from app.core.state import SchedulerState, apply
from app.core.wait import time_to_start_ns, wait_ns
from app.runtime.admission import BatchLines, Refused, WaitEstimates, check_bounds
from app.runtime.api import (
    SHUTTING_DOWN,
    Admission,
    Detached,
    Ticket,
    new_request_id,
)
from app.runtime.load_outcomes import LoadOutcomes
from app.runtime.log_buffer import LogBuffer
from app.runtime.metrics import Metrics
from app.runtime.parameters import server_started
from app.runtime.places import Places
from app.runtime.ports import Cancellable, EventSink, Timers, first_of
from app.runtime.processes import Upstream, UpstreamFactory
from app.runtime.reload import adopt, process_identity, reload_summary
from app.runtime.stops import Stops
from app.runtime.swaps import Swaps
from app.runtime.time_limits import TimeLimits
from app.runtime.upstream import UpstreamStartError
from app.runtime.views import SchedulerViews

log = logging.getLogger("gpulane.scheduler")

EXIT_WAIT_S = 0.5
"""How long a failed request waits for its server's exit, to tell whether it
died out of GPU memory (`died_out_of_memory`)."""


class Scheduler(SchedulerViews, Stops, TimeLimits, LoadOutcomes):
    """The run loop. Its parts, each in a module named for what it holds:
    the web layer's read-only views (views.py), unload and drain (stops.py),
    time limits (time_limits.py), what a load's end means (load_outcomes.py)."""

    def __init__(
        self,
        config: Config,
        store: EventSink,
        *,
        logs: LogBuffer,
        clock: Callable[[], int] = time.time_ns,
        timers: Timers | None = None,
        upstreams: UpstreamFactory | None = None,
        owner: str = "",
    ) -> None:
        """`clock` (unix ns) stamps every event and measures swaps and idle time;
        `timers` runs TTLs and time limits; `upstreams` builds model servers."""
        self.config = config
        self.store = store
        # While the log refuses writes nothing starts; once it accepts them
        # again, whatever waited is dispatched.
        store.on_change(self.pump)
        self.logs = logs
        self.clock = clock
        self._timers: Timers = timers or asyncio.get_running_loop()
        self.swaps = Swaps(self, config, self._timers, upstreams, logs=logs, owner=owner)
        """Loads, stops, TTL and back-off: recorded, then carried out by its processes."""
        self.processes = self.swaps.processes
        """The model servers (the effects): what each model runs."""
        self.owner = owner
        """Names this server's database in its upstreams' environment (recovery)."""
        self.state = SchedulerState()
        # The parameters as every reader of the log gets them: from server_started.
        apply(self.state, server_started(config, 0, 0))
        self.run_estimates = RunEstimates()
        """Expected run times, recorded in each enqueue (seeded from the log by serve)."""
        self.lane_history = LaneHistory()
        """Lane time taken per hour, for forecasting the work that overtakes a run
        (a batch's, a chain's finish; seeded from the log by serve)."""
        self.metrics = Metrics(lambda: self.state, clock, callers=config.caller_labels())
        self.tickets: dict[str, Ticket] = {}
        self.running_since: dict[str, int] = {}
        self._served_by: dict[str, asyncio.Task[Any]] = {}
        self._deadlines: dict[str, Cancellable] = {}
        """maxRunTime timers of running requests."""
        self._waits = WaitEstimates(self.durations)
        """Retry-After of refusals and deadlines, recomputed at most once a second."""
        self.batch_lines = BatchLines()
        """Open Batch API lines: outside the per-caller bound (docs/jobs.md)."""
        self._max_waits: dict[str, Cancellable] = {}
        """X-Gpulane-Max-Wait timers of waiting requests."""
        self._send_again: Callable[[Ticket, Any], None] | None = None
        """Sends a durable job put back in the queue while it ran (`on_put_back`)."""
        self._uncommitted: set[str] = set()
        """Durable enqueues not yet on disk: they may not be dispatched until they are."""
        self.draining = False
        self.may_dispatch: Callable[[], bool] = lambda: True
        """False while this server may not trust its lease (serve sets it: a
        leader paused or cut off past its lease dispatches nothing; leadership.py)."""
        self._idle: asyncio.Future[None] | None = None
        self._last_commit: asyncio.Future[list[int]] | None = None
        """The newest emit's commit: `recorded` waits for it."""
        self.version = 0
        """Moves on with every change of the state (each `emit`): readers that
        derive something costly from the state keep it per version."""
        self.places = Places(self.live, lambda: self.version, self.durations)
        """Waiting requests' places in the live queue's order, when asked."""

    # -- wiring (serve) ----------------------------------------------------------

    def learn(
        self, runs: Iterable[tuple[str, str, float]], loads: Iterable[tuple[str, float]]
    ) -> None:
        """Seed the expected run and load times from the log: (model, endpoint,
        run ms) and (model, load ms), oldest first."""
        for model, endpoint, run_ms in runs:
            self.run_estimates.observe(model, endpoint, int(run_ms * 1e6))
        for model, load_ms in loads:
            self.run_estimates.observe_load(model, int(load_ms * 1e6))

    def before_each_stop(self, release: Callable[[str], Awaitable[None]]) -> None:
        """`release(model)` runs before a model's process is stopped (serve closes
        idle connections to it)."""
        self.processes.before_stop = release

    def kill_upstreams(self) -> None:
        """SIGKILL every model server, recording nothing (a fenced server)."""
        self.processes.kill_all()

    # -- messages ------------------------------------------------------------

    def emit(self, events: Iterable[ev.AnyEvent]) -> asyncio.Future[list[int]]:
        """Apply events to the state and hand them to the log, in one order.
        The returned future resolves when they are committed."""
        batch = list(events)
        self.version += 1
        for event in batch:
            self.lane_history.observe(event, self.state)  # reads the state before it
            apply(self.state, event)
            self.metrics.observe(event, self.state)
        fut = self.store.submit(batch)
        fut.add_done_callback(_consume_error)
        self._last_commit = fut
        return fut

    async def recorded(self, timeout: float) -> None:
        """Wait, at most `timeout` seconds, until everything emitted so far is on
        disk (the store commits in order), so a reader of the log that comes next
        sees it. A refusing store only makes this return later, never fail."""
        fut = self._last_commit
        if fut is None or fut.done():
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(fut), timeout)

    def restore(self, restored: ev.RequestRestored, endpoint: str) -> Ticket:
        """The ticket of a job recovery puts back. The state changes only when the
        caller emits `restored`, with the rest of recovery in one batch, so the log
        records every job put back (app/runtime/recovery.py)."""
        ticket = Ticket(
            restored.request_id,
            restored.model,
            restored.priority,
            restored.enqueued_at,
            endpoint,
        )
        self.tickets[ticket.request_id] = ticket
        self._arm_max_wait(ticket.request_id, restored.max_wait_ns, restored.enqueued_at)
        return ticket

    def admit(self, admission: Admission, *, pump: bool = True) -> Ticket:
        """Queue a request (RequestEnqueued) and dispatch whatever can run now.

        A durable job is not dispatched until its enqueue is on disk, and if
        that commit fails it leaves no trace in the queue: its caller awaits
        `ticket.committed` (StoreError when the commit failed) before answering.
        `pump=False` (many admissions at once): the caller pumps once they are committed."""
        ticket = self._enqueue(admission)
        if admission.durable:
            rid = ticket.request_id
            self._uncommitted.add(rid)

            def on_commit(fut: asyncio.Future[list[int]]) -> None:
                self._uncommitted.discard(rid)
                if fut.cancelled() or fut.exception() is not None:
                    self._withdraw(rid)
                if pump:
                    self.pump()

            assert ticket.committed is not None
            ticket.committed.add_done_callback(on_commit)
        if pump:
            self.pump()
        return ticket

    def _enqueue(self, admission: Admission) -> Ticket:
        if self.draining:
            raise Refused(SHUTTING_DOWN, code="shutting_down")
        if self.store.failure is not None:
            raise Refused(
                f"the event log cannot be written: {self.store.failure}; nothing new is "
                "admitted until it can, running work goes on",
                retry_after=max(1, math.ceil(self.store.retry_in)),
            )
        now = self.clock()
        arriving = self.state.newcomer(
            admission.model,
            admission.priority,
            now,
            caller=admission.caller,
            expected_run_ns=self.run_estimates.expected(admission.model, admission.endpoint),
            endpoint=admission.endpoint,
        )
        line = bool(admission.job and admission.job.get("batch_id"))
        check_bounds(
            self.config,
            self.state,
            arriving,
            self.running_since,
            now,
            self._waits,
            self.batch_lines,
            batch_line=line,
        )
        ticket = Ticket(
            admission.request_id or new_request_id(),
            admission.model,
            admission.priority,
            now,
            admission.endpoint,
        )
        self.tickets[ticket.request_id] = ticket
        if line:
            self.batch_lines.add(admission.caller, ticket.request_id)
        enqueued = admission.enqueued(now, ticket.request_id, arriving.expected_run_ns)
        ticket.committed = self.emit([enqueued])
        self._arm_max_wait(ticket.request_id, admission.max_wait_ns, now)
        return ticket

    def _withdraw(self, request_id: str) -> None:
        """Forget a request whose enqueue never reached the disk. Applied, not
        recorded: the log never held it, so state and log agree again."""
        self.version += 1
        apply(
            self.state,
            ev.RequestCancelled(at=self.clock(), request_id=request_id, reason="explicit"),
        )
        ticket = self.tickets.pop(request_id, None)
        if ticket is not None and not ticket.ready.done():
            ticket.ready.cancel()

    def refused(self, admission: Admission, exc: Refused) -> str:
        """`admit` refused this request: recorded with its reason. The record's id
        is returned and kept on `exc` (`recorded_as`), for the answer's X-Request-Id."""
        exc.recorded_as = self.reject(
            admission.endpoint,
            exc.status,
            str(exc),
            admission.model_requested,
            admission.priority,
            admission.caller,
            reason=exc.reason,
        )
        return exc.recorded_as

    def reject(
        self,
        endpoint: str,
        status: int,
        message: str,
        model: str | None,
        priority: int,
        caller: str | None,
        *,
        reason: str | None = None,
    ) -> str:
        """A request refused at admission: recorded so every request seen has a row.
        Its id, for the refusal's X-Request-Id (`gpulane explain` finds it)."""
        request_id = new_request_id()
        self.emit(
            [
                ev.RequestRejected(
                    at=self.clock(),
                    request_id=request_id,
                    endpoint=_cut(endpoint),
                    http_status=status,
                    error=_cut(message),
                    model_requested=None if model is None else _cut(model),
                    priority=priority,
                    band=band_of(priority),
                    caller=caller,
                    reason=reason,
                )
            ]
        )
        return request_id

    # -- facts from the task serving a request ---------------------------------

    def supervise(self, request_id: str, task: asyncio.Task[Any]) -> None:
        """`task` serves this request. If it ends while the request is still
        open, whatever happened is recorded as the request's end."""
        self._served_by[request_id] = task
        task.add_done_callback(lambda t: self._served_task_done(request_id, t))

    def started(self, request_id: str, dropped_headers: Iterable[str] = ()) -> None:
        if request_id in self.state.running:
            now, ticket = self.clock(), self.tickets.get(request_id)
            if ticket is not None:
                ticket.time_to_start_ms = time_to_start_ns(ticket.enqueued_ns, now) / 1e6
            self.emit(
                [
                    ev.RequestStarted(
                        at=now,
                        request_id=request_id,
                        dropped_headers=list(dropped_headers),
                    )
                ]
            )

    def progressed(self, request_id: str, done: int, total: int) -> None:
        """A running job said how far it is (sampled by its sender)."""
        if request_id in self.state.running and total > 0:
            self.emit(
                [
                    ev.RequestProgressed(
                        at=self.clock(), request_id=request_id, done=done, total=total
                    )
                ]
            )

    def completed(self, request_id: str, http_status: int, **facts: Any) -> None:
        """The whole answer went through (facts: RequestCompleted's optional fields)."""
        if request_id in self.state.running:
            ticket = self.tickets.get(request_id)
            run_ms = facts.get("run_ms")
            if ticket is not None and run_ms is not None:
                self.run_estimates.observe(ticket.model, ticket.endpoint, int(run_ms * 1e6))
            self._end(
                ev.RequestCompleted(
                    at=self.clock(), request_id=request_id, http_status=http_status, **facts
                )
            )

    def failed(
        self, request_id: str, error: str, http_status: int | None, *, hung: bool = False
    ) -> None:
        """The request could not be served. `hung`: the upstream stopped answering,
        so it is restarted (the next request for it loads it again)."""
        model = self.state.running.get(request_id)
        if model is None:
            return
        if hung:
            # Stopped first, so the next dispatch to this model loads it afresh.
            log.warning("upstream %s hung (%s): restarting it", model, error)
            self.swaps.stop(model, "hung")
        self._end(
            ev.RequestFailed(
                at=self.clock(), request_id=request_id, error=error, http_status=http_status
            )
        )

    def client_gone(self, request_id: str) -> None:
        """The client disconnected, queued or running."""
        if request_id in self.state.requests:
            self._end(
                ev.RequestCancelled(at=self.clock(), request_id=request_id, reason="client_gone")
            )

    def cancel_any(self, request_id: str) -> str | None:
        """An operator cancels a request, queued or running: it is recorded as
        cancelled and its lane is free at once, even if the upstream does not
        answer. Returns what it was ("queued" or "running"), None if not open."""
        request = self.state.requests.get(request_id)
        if request is None:
            return None
        was = "running" if request.running else "queued"
        self._end(
            ev.RequestCancelled(at=self.clock(), request_id=request_id, reason="explicit"),
            Detached(409, "request_cancelled", f"request {request_id} was cancelled"),
        )
        return was

    async def died_out_of_memory(self, proc: Upstream | None) -> str | None:
        """The line `proc` (the server a request was sent to, `processes.get`
        then) printed saying the GPU ran out of memory, once it has exited by
        itself; None when it runs on, was stopped, or said nothing so. A dropped
        connection is often seen before the exit: waits up to `EXIT_WAIT_S` for it."""
        if proc is None or proc.pid is None:
            return None
        if proc.running:
            exited = asyncio.ensure_future(proc.wait_exit())
            await first_of(self._timers, exited, EXIT_WAIT_S)
            exited.cancel()  # no-op once done
        return None if proc.running or proc.stopping else proc.out_of_memory

    async def reload_crashed(self, request_id: str) -> bool:
        """The request's upstream refused the connection: if its process died
        (a crash racing this dispatch), load it again for this request and say
        True; False when the process is alive, so the error is real."""
        model = self.state.running.get(request_id)
        # A leader that may not trust its lease starts no process (may_dispatch).
        if model is None or self.draining or not self.may_dispatch():
            return False
        proc = self.processes.get(model)
        if proc is not None:
            exited = asyncio.ensure_future(proc.wait_exit())
            await first_of(self._timers, exited, 1.0)
            exited.cancel()  # no-op once done
            if proc.running:
                return False
        ticket = self.tickets.get(request_id)
        if ticket is None or request_id not in self.state.running or self.draining:
            return False
        ticket.ready = asyncio.get_running_loop().create_future()
        if model not in self.state.loads:
            self.swaps.begin(model, request_id)
        try:
            await ticket.ready
        except (asyncio.CancelledError, UpstreamStartError):
            return False
        return True

    def reload(self, new: Config) -> ev.ConfigReloaded | None:
        """Run under `new` from the next decision (SIGHUP, `-watch-config`;
        app/runtime/reload.py), keeping the queue. What the change does is the
        core's (`core.reload.plan_reload`): waiting requests of a removed model
        fail (404), its running ones finish; a removed or changed model stops
        once idle. None while draining (the next start reads the file anyway)."""
        if self.draining:
            return None
        old = self.config
        before = dict(old.models)
        processes = process_identity(old), process_identity(new)
        plan = plan_reload(self.state, *processes, self.loaded_models())
        for rid in plan.failed:
            model = self.state.requests[rid].model
            why = f"model {model!r} was removed from the config by a reload before it started"
            self._end(
                ev.RequestFailed(at=self.clock(), request_id=rid, error=why, http_status=404),
                Detached(404, "model_not_found", why),
            )
        kept = adopt(old, new)
        for name in kept:
            log.warning("reload: %s changed; it takes effect at the next start", name)
        now = self.clock()
        event = ev.ConfigReloaded(
            at=now,
            config_hash=old.config_hash,
            parameters=server_started(old, now, os.getpid()),
            source=old.source,
            added=plan.added,
            removed=plan.removed,
            restarted=plan.restarted,
        )
        self.emit([event])
        summary = reload_summary(plan, *processes)
        log.info("config reloaded from %s (hash %s): %s", old.source, old.config_hash, summary)
        self.swaps.retire(plan.restarted, before)
        self.pump()
        return event

    def preload_all(self, models: Iterable[str]) -> list[str]:
        """`hooks.on_startup.preload` (`Swaps.preload_all`); the models loading."""
        return [] if self.draining else self.swaps.preload_all(models)

    def preload(self, model: str) -> bool:
        """Load `model` for no request, if that evicts only idle models."""
        return not self.draining and self.swaps.preload(model)

    def pump(self) -> None:
        """Dispatch until the policy says nothing more can run now. Nothing
        starts while the log refuses writes (`store.failure`), nor while the
        lease is not to be trusted (`may_dispatch`)."""
        while not self.draining and self.store.failure is None and self.may_dispatch():
            now = self.clock()
            decision = decide(self.state, now)
            if decision is None:
                return
            dispatched = decision.dispatched
            if dispatched.request_id in self._uncommitted:
                return  # the winner is not on disk yet: decide again once it is
            enqueued = self.state.requests[dispatched.request_id].enqueued_ns
            self.emit(decision.events)
            self.running_since[dispatched.request_id] = now
            ticket = self.tickets.get(dispatched.request_id)
            if ticket is None:
                self._no_sender(dispatched.request_id, "was dispatched")
                continue
            ticket.score = decision.scores.winner.total
            ticket.queue_wait_ms = wait_ns(enqueued, now, now) / 1e6
            if decision.action == "swap":
                self.swaps.begin(dispatched.model, dispatched.request_id, decision.evicted)
            elif decision.action == "run":
                self._release(dispatched.request_id, dispatched.model)
            # "join": released by _swap_done when the load in progress ends

    # -- internals -----------------------------------------------------------

    def _end(self, event: ev.AnyEvent, detach: Detached | None = None) -> bool:
        """Record a request's one terminal event; False (nothing recorded) when
        it has already ended."""
        request_id = ev.request_id_of(event)
        assert request_id is not None
        request = self.state.requests.get(request_id)
        if request is None:
            return False
        self.emit([event])
        self._detach(request_id, detach)
        status = ev.type_name(event).removeprefix("request_")  # completed, failed, ...
        self.metrics.observe_finish(band_of(request.priority), status)
        self.swaps.used(request.model)
        if self._idle is not None and not self.state.running and not self._idle.done():
            self._idle.set_result(None)
        self.pump()
        return True

    def _detach(self, request_id: str, detach: Detached | None) -> None:
        """The request no longer runs here: forget its serving task and time
        limit, and tell whoever serves it why (None: it told us)."""
        self.running_since.pop(request_id, None)
        self._served_by.pop(request_id, None)
        for timers in (self._deadlines, self._max_waits):
            timer = timers.pop(request_id, None)
            if timer is not None:
                timer.cancel()
        ticket = self.tickets.pop(request_id, None)
        if ticket is None:
            return
        if not ticket.ready.done():
            ticket.ready.cancel()
        if detach is not None and not ticket.detached.done():
            ticket.detached.set_result(detach)

    def _served_task_done(self, request_id: str, task: asyncio.Task[Any]) -> None:
        if self._served_by.get(request_id) is not task:
            return  # the request ended, or a later attempt has its own task
        del self._served_by[request_id]
        request = self.state.requests.get(request_id)
        if request is None:
            return
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            log.error("serving request %s failed", request_id, exc_info=exc)
        if exc is None and not request.running:
            self.client_gone(request_id)  # its handler returned: nobody waits for it
            return
        what = "was cancelled" if exc is None else f"raised {type(exc).__name__}: {exc}"
        self._end(
            ev.RequestFailed(
                at=self.clock(),
                request_id=request_id,
                error=f"internal error: the task serving the request {what}",
                http_status=500,
            )
        )

    def _release(self, request_id: str, model: str) -> None:
        ticket = self.tickets.get(request_id)
        if ticket is None:
            self._no_sender(request_id, "was released to run")
            return
        spec = self.swaps.spec(model)
        if spec.peer is not None:  # no process: the peer's URL, reachable when probed
            self._hand_over(ticket, spec.proxy, model)
            return
        proc = self.processes.get(model)
        if proc is None or not proc.running:
            if self.draining:
                return  # no swap starts during shutdown; drain ends the request
            # The process went away between decision and release (TTL stop, crash):
            # load it again rather than send the request to nothing.
            self.swaps.begin(model, request_id)
            return
        self._hand_over(ticket, proc.spec.proxy, model)

    async def shutdown(self) -> None:
        """Stop every upstream (ProcessStopped, reason shutdown) and wait for them."""
        await self.swaps.shutdown()


def _consume_error(fut: asyncio.Future[Any]) -> None:
    # Append failures are reported through store.failure; don't warn per future.
    if not fut.cancelled():
        fut.exception()


REJECTED_FIELD_CHARS = 1024
"""A refusal's record keeps this much of what the caller sent: a refused
request must not cost the log its whole body (a 1 MiB model name, quoted)."""


def _cut(text: str) -> str:
    if len(text) <= REJECTED_FIELD_CHARS:
        return text
    more = len(text) - REJECTED_FIELD_CHARS
    return f"{text[:REJECTED_FIELD_CHARS]}… ({more} more characters cut)"
