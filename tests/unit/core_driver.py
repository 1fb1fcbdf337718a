"""CoreDriver: a SchedulerState, a clock and the decisions made so far, for unit tests.

It feeds the pure core exactly as the run loop does: every change is an event folded in
with `apply` (the scheduler and its parameters too: a `server_started`), and `decide` is
called until it returns nothing (each pick's reorder reasons checked against its
recorded scores). Swaps and completions are instant unless a test drives them step by
step. `restart` is a new process and what its recovery records.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgspec

from app.core import events as ev
from app.core.load_backoff import NO_BACKOFF, LoadBackoff
from app.core.policy import decide, pick_reasons, reorder_reasons
from app.core.priority import band_of
from app.core.scoring import NS_PER_S, ScoringParams
from app.core.state import SERIAL, SchedulerState, apply

T0 = 1_700_000_000 * NS_PER_S
"""A realistic unix time in ns, so enqueue times are large as in production."""


class CoreDriver:
    """Holds the scheduler state, the clock (`now`) and every ScoresComputed/dispatch."""

    def __init__(
        self,
        params: ScoringParams | None = None,
        *,
        scheduler: str = SERIAL,
        resident: str | None = None,
        model_priority: Mapping[str, int] | None = None,
        concurrency: Mapping[str, int] | None = None,
        caller_weights: Mapping[str, int] | None = None,
        now_ns: int = T0,
        load_backoff: LoadBackoff = NO_BACKOFF,
    ) -> None:
        self.state = SchedulerState()
        self.now = now_ns
        self.log: list[ev.AnyEvent] = []
        """Every event folded, in order: the log a server would have written."""
        self.scores: list[ev.ScoresComputed] = []
        self.dispatches: list[ev.RequestDispatched] = []
        self.start_server(
            params or ScoringParams(),
            scheduler=scheduler,
            model_priority=model_priority,
            concurrency=concurrency,
            caller_weights=caller_weights,
            load_backoff=load_backoff,
        )
        if resident is not None:
            self.load(resident)

    # -- events in ----------------------------------------------------------

    def apply(self, event: ev.AnyEvent) -> None:
        apply(self.state, event)
        self.log.append(event)

    def start_server(
        self,
        params: ScoringParams,
        *,
        scheduler: str = SERIAL,
        model_priority: Mapping[str, int] | None = None,
        concurrency: Mapping[str, int] | None = None,
        caller_weights: Mapping[str, int] | None = None,
        log_format: int = ev.LOG_FORMAT,
        load_backoff: LoadBackoff = NO_BACKOFF,
    ) -> None:
        self.apply(
            ev.ServerStarted(
                at=self.now,
                version="test",
                config_hash="",
                scheduler=scheduler,
                aging_divisor_ns=params.aging_divisor_ns,
                swap_affinity_bonus=params.swap_affinity_bonus,
                model_priority=dict(model_priority or {}),
                concurrency=dict(concurrency or {}),
                log_format=log_format,
                fair_share_bonus=params.fair_share_bonus,
                short_job_bonus=params.short_job_bonus,
                caller_weights=dict(caller_weights or {}),
                load_backoff_ns=load_backoff.first_ns,
                load_backoff_max_ns=load_backoff.max_ns,
                load_failure_limit=load_backoff.failure_limit,
            )
        )

    def restart(
        self,
        params: ScoringParams | None = None,
        *,
        model_priority: Mapping[str, int] | None = None,
        log_format: int = ev.LOG_FORMAT,
    ) -> None:
        """A new process (same parameters unless given) and what app/runtime/recovery.py
        records: each open durable request restored (arrival order), a running one
        re-queued (attempt + 1) right after its own restore, so it keeps its arrival
        place on ties; synchronous ones abandoned. With `log_format` 1, what an older
        version recorded: no restores, and the running ones re-queued after all."""
        before = [msgspec.structs.replace(r) for r in self.state.requests.values()]
        state = self.state
        self.start_server(
            params or state.params,
            scheduler=state.scheduler,
            model_priority=state.model_priority if model_priority is None else model_priority,
            concurrency=state.concurrency,
            caller_weights=state.caller_weights,
            log_format=log_format,
        )
        requeues: list[ev.AnyEvent] = []
        for r in before:
            if not r.durable:
                self.apply(ev.RequestAbandoned(at=self.now, request_id=r.request_id))
                continue
            if log_format >= 2:
                self.apply(
                    ev.RequestRestored(
                        at=self.now,
                        request_id=r.request_id,
                        model=r.model,
                        priority=r.priority,
                        enqueued_at=r.enqueued_ns,
                        attempt=r.attempt,
                        caller=r.caller,
                        expected_run_ns=r.expected_run_ns,
                        endpoint=r.endpoint,
                    )
                )
            if r.running:
                requeue = ev.RequestRequeued(
                    at=self.now, request_id=r.request_id, attempt=r.attempt + 1
                )
                if log_format >= 2:
                    self.apply(requeue)
                else:
                    requeues.append(requeue)
        for event in requeues:
            self.apply(event)
        self.apply(ev.RecoveryFinished(at=self.now))

    def advance(self, ns: int) -> None:
        assert ns >= 0
        self.now += ns

    def at(self, ns: int) -> None:
        """Set the clock to T0 + ns (may not go back)."""
        assert T0 + ns >= self.now
        self.now = T0 + ns

    def enqueue(
        self,
        request_id: str,
        model: str,
        priority: int = 0,
        *,
        durable: bool = False,
        caller: str | None = None,
        expected_run_ns: int | None = None,
        endpoint: str = "/v1/chat/completions",
    ) -> None:
        self.apply(
            ev.RequestEnqueued(
                at=self.now,
                request_id=request_id,
                model=model,
                model_requested=model,
                endpoint=endpoint,
                priority=priority,
                band=band_of(priority),
                durable=durable,
                caller=caller,
                expected_run_ns=expected_run_ns,
            )
        )

    def start_swap(self, model: str, request_id: str | None = None) -> None:
        self.apply(
            ev.SwapStarted(
                at=self.now, from_model=self.state.resident, to_model=model, request_id=request_id
            )
        )

    def finish_swap(self, model: str) -> None:
        self.apply(ev.SwapFinished(at=self.now, model=model, duration_ms=0.0))

    def fail_swap(self, model: str, error: str = "exited with code 1 during start") -> None:
        """The load of `model` failed: its swap_failed, then the requests on it fail."""
        on_it = [rid for rid, m in self.state.running.items() if m == model]
        self.apply(ev.SwapFailed(at=self.now, model=model, error=error))
        for rid in on_it:
            self.apply(ev.RequestFailed(at=self.now, request_id=rid, error=error))

    def load(self, model: str) -> None:
        self.start_swap(model)
        self.finish_swap(model)

    def complete(self, request_id: str) -> None:
        self.apply(ev.RequestCompleted(at=self.now, request_id=request_id, http_status=200))

    def cancel(self, request_id: str) -> None:
        self.apply(ev.RequestCancelled(at=self.now, request_id=request_id, reason="client_gone"))

    # -- decisions ----------------------------------------------------------

    def step(self) -> ev.RequestDispatched | None:
        """One `decide` at `now`; its events are applied and recorded."""
        decision = decide(self.state, self.now)
        if decision is None:
            return None
        # `decide` is `choose` plus its scores: what an unrecorded replay counts as
        # reorders (from the pick) must be what the recorded scores say.
        assert pick_reasons(decision.pick) == reorder_reasons(decision.scores)
        scores, dispatched = decision.scores, decision.dispatched
        assert scores.request_id == dispatched.request_id
        for event in decision.events:
            self.apply(event)
        self.scores.append(scores)
        self.dispatches.append(dispatched)
        return dispatched

    def dispatch_all(self) -> list[str]:
        """Call `decide` until it returns nothing; the ids dispatched, in order."""
        out = []
        while (d := self.step()) is not None:
            out.append(d.request_id)
        return out

    def serve_all(self, run_ns: Callable[[str], int] | None = None) -> list[str]:
        """Run the serial GPU dry: dispatch, swap when asked (instantly), run for
        `run_ns(request_id)` (default: no time), complete, repeat."""
        out = []
        while (d := self.step()) is not None:
            if d.swap:
                self.start_swap(d.model, d.request_id)
                self.finish_swap(d.model)
            if run_ns is not None:
                self.advance(run_ns(d.request_id))
            self.complete(d.request_id)
            out.append(d.request_id)
        return out


def snapshot(state: SchedulerState) -> dict[str, object]:
    """Everything a decision depends on, comparable with ==: the open requests (in
    first-arrival order), the queue in dispatch order (arrival tie-break included),
    what runs, what is loaded, and the parameters."""
    return {
        "requests": [msgspec.to_builtins(r) for r in state.requests.values()],
        "queue": [msgspec.to_builtins(q) for q in state.queue.ranked(state.resident)],
        "running": dict(state.running),
        "resident": state.resident,
        "loading": state.loading,
        "scheduler": state.scheduler,
        "params": msgspec.to_builtins(state.params),
        "model_priority": dict(state.model_priority),
        "concurrency": dict(state.concurrency),
        "config_hash": state.config_hash,
    }
