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
from typing import Any, Literal

from prometheus_client import CollectorRegistry

from app.config import Config
from app.core import events as ev
from app.core.drain import Fate, after_grace, cancelled_at_stop
from app.core.lane_history import LaneHistory
from app.core.peers import another_peer_left
from app.core.policy import decide, given_up
from app.core.priority import band_of
from app.core.reload import plan_reload
from app.core.run_estimate import Durations, RunEstimates
from app.core.state import SchedulerState, apply
from app.core.wait import wait_ns
from app.runtime.admission import BatchLines, Refused, WaitEstimates, check_bounds
from app.runtime.api import (
    SHUTTING_DOWN,
    Admission,
    Detached,
    LiveState,
    ModelStatus,
    OpenStatus,
    Ticket,
    new_request_id,
)
from app.runtime.gpu import MemoryStatus
from app.runtime.log_buffer import LogBuffer
from app.runtime.metrics import Metrics
from app.runtime.parameters import server_started
from app.runtime.places import Places
from app.runtime.ports import Cancellable, EventSink, Timers, first_of
from app.runtime.processes import UpstreamFactory
from app.runtime.reload import adopt, process_identity
from app.runtime.swaps import Swaps
from app.runtime.upstream import UpstreamStartError

log = logging.getLogger("gpulane.scheduler")


class Scheduler:
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

    # -- read-only views for the web layer --------------------------------------

    @property
    def resident(self) -> str | None:
        """The model that became ready last (`residents` has them all)."""
        return self.state.resident

    @property
    def residents(self) -> list[str]:
        """The models loaded and ready, in the order they became so."""
        return list(self.state.residents)

    def target_of(self, request_id: str, model: str) -> str:
        """The model a dispatched request runs on: `model`, or for a model several
        peers serve, the peer's entry the scheduler chose (`app.core.peers`)."""
        return self.state.running.get(request_id) or model

    def is_resident(self, model: str) -> bool:
        return model in self.state.residents

    def durations(self) -> Durations:
        """Each model's run and load times as learnt so far (`run_estimates`): what
        every estimate of this server counts (the live queue, a batch's ETA,
        Retry-After; app/core/start_estimate.py)."""
        return self.run_estimates.durations()

    def live(self) -> LiveState:
        return LiveState(state=self.state, running_since=self.running_since, now_ns=self.clock())

    def open_status(self, request_id: str) -> OpenStatus | None:
        request = self.state.requests.get(request_id)
        if request is None:
            return None
        status: Literal["queued", "running"] = "running" if request.running else "queued"
        queued = self.state.queue.get(request_id)
        if queued is None:
            return OpenStatus(status=status, attempt=request.attempt)
        score = self.state.score(queued, self.clock())
        return OpenStatus(status=status, attempt=request.attempt, score=score)

    async def ahead(self, request_id: str) -> int | None:
        """How many waiting requests go before this one in the live queue's order
        (0: it goes next), None when it does not wait: computed when asked, kept
        while the state does not change (app/runtime/places.py)."""
        return await self.places.ahead(request_id)

    def model_status(self, model: str) -> ModelStatus:
        proc = self.processes.get(model)
        if model in self.state.loads:
            state: Literal["starting", "ready", "stopping", "stopped"] = "starting"
        elif proc is not None and proc.running:
            state = "ready"
        elif model in self.processes.stopping():
            state = "stopping"
        else:
            state = "stopped"
        pid = None if proc is None else proc.pid
        return ModelStatus(state=state, pid=pid, in_flight=self.state.running_on(model))

    def log_refusal(self) -> tuple[str, int] | None:
        """Why the event log refuses writes now and the seconds until it is tried
        again (at least 1); None while it accepts them."""
        failure = self.store.failure
        if failure is None:
            return None
        return failure, max(1, math.ceil(self.store.retry_in))

    def metrics_registry(self) -> CollectorRegistry:
        return self.metrics.registry

    def memory_status(self) -> MemoryStatus:
        """GPU memory for the console: the GPU, the budget, each model's footprint."""
        return self.swaps.memory_status()

    def loaded_models(self) -> list[str]:
        """Models with a server process (running or starting), in spawn order."""
        return self.processes.models()

    def stopping_models(self) -> list[str]:
        """Models whose process is being stopped now, sorted."""
        return sorted(self.processes.stopping())

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

    def _arm_max_wait(self, request_id: str, max_wait_ns: int | None, enqueued_ns: int) -> None:
        if max_wait_ns is None:
            return
        left = max(0, enqueued_ns + max_wait_ns - self.clock()) / 1e9
        self._max_waits[request_id] = self._timers.call_later(
            left, self._waited_too_long, request_id, max_wait_ns
        )

    def _waited_too_long(self, request_id: str, max_wait_ns: int) -> None:
        """The caller's X-Gpulane-Max-Wait passed while it still waits: cancelled
        (reason `deadline`), answered 503 with the wait it would still have."""
        self._max_waits.pop(request_id, None)
        queued = self.state.queue.get(request_id)
        if queued is None:
            return  # dispatched (or gone) in time
        left = self._waits.get(self.state, queued, self.running_since, self.clock())
        message = (
            f"request {request_id} waited its X-Gpulane-Max-Wait ({max_wait_ns / 1e9:g} s) "
            f"in the queue without starting; estimated wait from now about {left} s"
        )
        self._end(
            ev.RequestCancelled(at=self.clock(), request_id=request_id, reason="deadline"),
            Detached(503, "deadline_exceeded", message, retry_after=left),
        )

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

    def refused(self, admission: Admission, exc: Refused) -> None:
        """`admit` refused this request: recorded with its reason."""
        self.reject(
            admission.endpoint,
            exc.status,
            str(exc),
            admission.model_requested,
            admission.priority,
            admission.caller,
            reason=exc.reason,
        )

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
    ) -> None:
        """A request refused at admission: recorded so every request seen has a row."""
        self.emit(
            [
                ev.RequestRejected(
                    at=self.clock(),
                    request_id=new_request_id(),
                    endpoint=endpoint,
                    http_status=status,
                    error=message,
                    model_requested=model,
                    priority=priority,
                    band=band_of(priority),
                    caller=caller,
                    reason=reason,
                )
            ]
        )

    # -- facts from the task serving a request ---------------------------------

    def supervise(self, request_id: str, task: asyncio.Task[Any]) -> None:
        """`task` serves this request. If it ends while the request is still
        open, whatever happened is recorded as the request's end."""
        self._served_by[request_id] = task
        task.add_done_callback(lambda t: self._served_task_done(request_id, t))

    def started(self, request_id: str, dropped_headers: Iterable[str] = ()) -> None:
        if request_id in self.state.running:
            self.emit(
                [
                    ev.RequestStarted(
                        at=self.clock(),
                        request_id=request_id,
                        dropped_headers=list(dropped_headers),
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

    async def unload(self, model: str | None) -> list[str]:
        """An operator unloads one model or every one (llama-swap's unload):
        each of its processes stops now, busy or not, and this returns once they
        have stopped. What runs on it ends as at the end of a drain's grace
        (`drain.after_grace`: a durable job is re-queued, a synchronous request
        fails with 503); what waits stays queued and loads it again in its turn."""
        targets = [m for m in self.processes.models() if model is None or m == model]
        for name in targets:
            self.swaps.stop(name, "unload")
        for name in targets:
            why = f"model {name!r} was unloaded by an operator before the request finished"
            self._cut_off(after_grace(self.state, name), why, Detached(503, "model_unloaded", why))
        await self.processes.stops_ended()
        return targets

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
        plan = plan_reload(
            self.state, process_identity(old), process_identity(new), self.processes.models()
        )
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
        log.info(
            "config reloaded from %s (hash %s): %d added, %d removed, %d to restart once idle",
            old.source,
            old.config_hash,
            len(plan.added),
            len(plan.removed),
            len(plan.restarted),
        )
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
            if ticket is not None:
                ticket.score = decision.scores.winner.total
                ticket.queue_wait_ms = wait_ns(enqueued, now, now) / 1e6
            if decision.action == "swap":
                self.swaps.begin(dispatched.model, dispatched.request_id, decision.evicted)
            elif decision.action == "run":
                self._release(dispatched.request_id, dispatched.model)
            # "join": released by _swap_done when the load in progress ends

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

    def _cut_off(self, fates: list[tuple[str, Fate]], why: str, detach: Detached) -> None:
        """End (`why`) or re-queue running requests whose server stops under them."""
        for request_id, fate in fates:
            if fate == "requeue":
                attempt = self.state.requests[request_id].attempt
                self.emit(
                    [ev.RequestRequeued(at=self.clock(), request_id=request_id, attempt=attempt)]
                )
                self._detach(request_id, detach)
            else:
                self._end(
                    ev.RequestFailed(
                        at=self.clock(), request_id=request_id, error=why, http_status=503
                    ),
                    detach,
                )

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
        spec = self.swaps.spec(model)
        if spec.peer is not None:  # no process: the peer's URL, reachable when probed
            if ticket is not None and not ticket.ready.done():
                ticket.ready.set_result(spec.proxy)
                self._arm_deadline(request_id, model)
            return
        proc = self.processes.get(model)
        if proc is None or not proc.running:
            if self.draining:
                return  # no swap starts during shutdown; drain ends the request
            # The process went away between decision and release (TTL stop, crash):
            # load it again rather than send the request to nothing.
            self.swaps.begin(model, request_id)
            return
        if ticket is not None and not ticket.ready.done():
            ticket.ready.set_result(proc.spec.proxy)
            self._arm_deadline(request_id, model)

    def _arm_deadline(self, request_id: str, model: str) -> None:
        limit = self.swaps.spec(model).max_run_time
        if limit is None or request_id in self._deadlines:
            return
        self._deadlines[request_id] = self._timers.call_later(
            limit, self._overran, request_id, limit
        )

    def _overran(self, request_id: str, limit: float) -> None:
        self._deadlines.pop(request_id, None)
        model = self.state.running.get(request_id)
        if model is None:
            return
        message = f"the request ran longer than maxRunTime ({limit:g} s) for model {model!r}"
        log.warning("request %s: %s; restarting the upstream", request_id, message)
        self.swaps.stop(model, "hung")
        self._end(
            ev.RequestFailed(
                at=self.clock(), request_id=request_id, error=message, http_status=504
            ),
            Detached(504, "upstream_timeout", message),
        )

    # -- what a load's end means for the requests waiting on it ---------------

    def load_ended(
        self, model: str, error: str | None, seconds: float, gpu_memory_mib: int | None = None
    ) -> None:
        """The load of `model` ended (`error`: how it failed): record it, then
        release the requests that waited for it, or fail them (or send them to
        another peer)."""
        now = self.clock()
        waiting = [rid for rid, m in self.state.running.items() if m == model]
        if error is None:
            log.info("%s is ready (loaded in %.1f s)", model, seconds)
            self.emit(
                [
                    ev.SwapFinished(
                        at=now,
                        model=model,
                        duration_ms=seconds * 1000,
                        gpu_memory_mib=gpu_memory_mib,
                    )
                ]
            )
            self.run_estimates.observe_load(model, int(seconds * 1e9))
            for rid in waiting:
                self._release(rid, model)
            self.swaps.arm_ttl(model)
        else:
            log.warning("loading %s failed: %s", model, error)
            self.emit([ev.SwapFailed(at=now, model=model, error=error, duration_ms=seconds * 1000)])
            for rid in waiting:
                if self._retry_on_another_peer(rid, model, error):
                    continue
                ticket = self.tickets.get(rid)
                if ticket is not None and not ticket.ready.done():
                    ticket.ready.set_exception(UpstreamStartError(error))
                self._end(ev.RequestFailed(at=now, request_id=rid, error=error, http_status=502))
            self._after_failed_load(model, error, now)
        self.pump()

    def _after_failed_load(self, model: str, error: str, now: int) -> None:
        """A load of `model` failed at `now` (recorded): at `loadFailureLimit`
        failures in a row its waiting requests fail with the loader's error
        (`given_up`); else they wait out its back-off, and a timer pumps when it ends."""
        failures = self.state.load_failures[model]
        doomed = given_up(self.state, model)
        if doomed:
            message = (
                f"model {model!r} failed to load {failures.count} times in a row "
                f"(loadFailureLimit {self.state.load_backoff.failure_limit}); "
                f"the last load failed: {error}"
            )
            log.warning("%s: failing its %d waiting requests", message, len(doomed))
            for rid in doomed:
                ticket = self.tickets.get(rid)
                if ticket is not None and not ticket.ready.done():
                    ticket.ready.set_exception(UpstreamStartError(message))
                self._end(ev.RequestFailed(at=now, request_id=rid, error=message, http_status=502))
        self.swaps.arm_backoff(model)

    def _retry_on_another_peer(self, request_id: str, model: str, error: str) -> bool:
        """A peer did not answer the probe for a request several peers may serve:
        put it back in the queue (recorded), so the next decision sends it to
        another peer (`peers.another_peer_left`); False when none is left."""
        request = self.state.requests.get(request_id)
        if request is None or model == request.model:
            return False
        choices = self.state.choices.get(request.model, ())
        if not another_peer_left(choices, model, self.state.load_failures.keys()):
            return False
        log.warning("request %s: %s; retrying it on another peer", request_id, error)
        self.emit(
            [ev.RequestRequeued(at=self.clock(), request_id=request_id, attempt=request.attempt)]
        )
        return True

    async def shutdown(self) -> None:
        """Stop every upstream (ProcessStopped, reason shutdown) and wait for them."""
        await self.swaps.shutdown()


def _consume_error(fut: asyncio.Future[Any]) -> None:
    # Append failures are reported through store.failure; don't warn per future.
    if not fut.cancelled():
        fut.exception()
