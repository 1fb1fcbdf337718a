"""Rules every event log must satisfy, checked by `gpulane db check`.

Pure: feed it `(seq, event)` pairs in seq order and read the violations.
A violation means the writer (or someone editing the file) broke the model
the rest of gpulane relies on, e.g. replay would diverge.

A request dispatched and free to run (its model loaded) that neither starts
nor ends within its model's `maxRunTime` while the log goes on was left with
nobody to send it: its lane is held for nothing (issue 38's wedge).

Besides the per-request rules, the log is folded with the core's own `apply`,
so a log whose state contradicts itself is caught where it first does: a
dispatch the lane had no room for (an earlier request's terminal event is
missing, so the log still has it running) or a swap away from a model that
the log says is still serving a request.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from app.core import events as ev
from app.core.policy import choose
from app.core.state import SchedulerState, apply


class Violation(msgspec.Struct, frozen=True):
    seq: int
    message: str


class _Request(msgspec.Struct):
    attempt: int
    terminal_seq: int | None = None
    """Seq of the terminal event of the current attempt, if any."""
    process: int = 0
    """The process (format-2 restarts so far) that enqueued or restored it."""
    chain: str | None = None
    """The chain its first enqueue named (`X-Gpulane-Chain`)."""


STALL_GRACE_NS = 10 * 10**9
"""Beyond `maxRunTime`: a deadline fires a moment late, and events of other
requests may be written in that moment before the request's own end."""


_LEAVES = (
    ev.RequestStarted,
    ev.RequestRequeued,  # back in the queue: a new dispatch to come
    ev.RequestRestored,
    ev.RequestCompleted,
    ev.RequestFailed,
    ev.RequestCancelled,
    ev.RequestAbandoned,
)
"""Events after which a dispatched request no longer waits to be sent."""


class _Unstarted(msgspec.Struct):
    """A dispatched request not yet started or ended."""

    seq: int
    model: str
    since: int | None
    """When it was free to run (dispatched, or its model's load ended); None
    while its model loads."""


class _Swap(msgspec.Struct, frozen=True):
    seq: int
    model: str


class LogAudit:
    """Checks events one at a time, keeping only per-request state."""

    def __init__(self) -> None:
        self.events = 0
        self.violations: list[Violation] = []
        self._requests: dict[str, _Request] = {}
        self._swaps: dict[str, _Swap] = {}
        """Loads in progress by model: one per model, and one in all without a
        router (one lane); with one, lanes load in parallel."""
        self._process = 0
        self._restart_seq = 0
        self._state = SchedulerState()
        self._dispatched_at: dict[str, int] = {}
        """Seq of each running request's dispatch, to name it in a violation."""
        self._max_run_ns: dict[str, int] = {}
        """Each model's `maxRunTime` as the latest `server_started` or reload says."""
        self._unstarted: dict[str, _Unstarted] = {}

    @property
    def requests(self) -> int:
        """Distinct requests enqueued so far."""
        return len(self._requests)

    def flag(self, seq: int, message: str) -> None:
        self.violations.append(Violation(seq, message))

    def feed(self, seq: int, event: ev.AnyEvent) -> None:
        self.events += 1
        self._check_state(seq, event)
        if self._unstarted:
            self._check_stalls(seq, event)
        try:
            apply(self._state, event)
        except Exception as exc:  # a log the core cannot fold is itself a violation
            self.flag(seq, f"{ev.type_name(event)} cannot be folded: {exc!r}")
        match event:
            case ev.RequestEnqueued(request_id=rid, attempt=attempt):
                first = rid not in self._requests
                self._new_attempt(rid, attempt)
                self._requests[rid].process = self._process
                self._chain(seq, event, first)
            case ev.RequestRestored(request_id=rid):
                self._restored(seq, rid)
            case ev.RequestRequeued(request_id=rid, attempt=attempt):
                if rid in self._requests:
                    self._new_attempt(rid, attempt)
                else:
                    self.flag(seq, f"request_requeued for {rid} with no earlier enqueue")
            case ev.RequestDispatched(request_id=rid, model=model, at=at):
                self._dispatched(seq, rid)
                since = None if model in self._swaps else at
                self._unstarted[rid] = _Unstarted(seq, model, since)
            case (
                ev.RequestCompleted()
                | ev.RequestFailed()
                | ev.RequestCancelled()
                | ev.RequestAbandoned()
                | ev.RequestRejected()
            ):
                self._terminal(seq, event)
            case ev.SwapStarted(to_model=model):
                self._loading(model, None)
                unfinished = self._swaps.get(model)
                if unfinished is None and self._state.router is None and self._swaps:
                    unfinished = next(iter(self._swaps.values()))
                if unfinished is not None:
                    self.flag(
                        seq,
                        f"swap to {model} started while the swap to {unfinished.model} "
                        f"(seq {unfinished.seq}) is unfinished",
                    )
                    if unfinished.model != model:
                        del self._swaps[unfinished.model]
                self._swaps[model] = _Swap(seq, model)
            case ev.SwapFinished(model=model) | ev.SwapFailed(model=model):
                self._swap_ended(seq, ev.type_name(event), model)
                self._loading(model, event.at)
            case ev.ConfigReloaded(parameters=parameters):
                self._max_run_ns = parameters.max_run_time_ns
            case ev.ServerStarted(log_format=log_format):
                # The previous process died: whatever swaps it was doing are over.
                self._swaps.clear()
                self._unstarted.clear()
                self._max_run_ns = event.max_run_time_ns
                if log_format >= 2:
                    # Its queue is what the restores after this put back.
                    self._process += 1
                    self._restart_seq = seq
            case _:
                pass

    def _loading(self, model: str, ended: int | None) -> None:
        """`model` started loading (None) or its load ended at `ended`: its
        dispatched requests wait for it, then are free to run."""
        for waiting in self._unstarted.values():
            if waiting.model == model:
                waiting.since = ended

    def _check_stalls(self, seq: int, event: ev.AnyEvent) -> None:
        """Requests free to run that neither started nor ended within their
        model's `maxRunTime` (and a grace) before `event`: each flagged once."""
        rid = ev.request_id_of(event)
        if rid is not None and isinstance(event, _LEAVES):
            self._unstarted.pop(rid, None)
        for other, waiting in list(self._unstarted.items()):
            limit = self._max_run_ns.get(waiting.model)
            if other == rid or limit is None or waiting.since is None:
                continue
            if event.at - waiting.since > limit + STALL_GRACE_NS:
                del self._unstarted[other]
                self.flag(
                    seq,
                    f"request {other}, dispatched at seq {waiting.seq} to {waiting.model}, "
                    f"neither started nor ended within its maxRunTime ({limit / 1e9:g} s) "
                    "while the log went on: nothing sent it upstream",
                )

    def _check_state(self, seq: int, event: ev.AnyEvent) -> None:
        """What the state before `event` says of it."""
        state = self._state
        if isinstance(event, ev.RequestDispatched):
            known = event.request_id in state.requests
            if known and state.running and choose(state, event.at) is None:
                busy = ", ".join(
                    f"{rid} (dispatched at seq {self._dispatched_at.get(rid, '?')})"
                    for rid in list(state.running)[:3]
                ) + (f" and {len(state.running) - 3} more" if len(state.running) > 3 else "")
                self.flag(
                    seq,
                    f"request_dispatched for {event.request_id} while the log still has "
                    f"{busy} running and no room beside it: a terminal event is missing",
                )
            self._dispatched_at[event.request_id] = seq
        elif isinstance(event, ev.SwapStarted):
            evicted = event.evicted
            if evicted is None:
                evicted = [] if event.from_model is None else [event.from_model]
            for model in evicted:
                serving = [rid for rid, m in state.running.items() if m == model]
                if serving:
                    self.flag(
                        seq,
                        f"swap from {model} started while the log has "
                        f"{', '.join(serving)} still running on it: a terminal event is missing",
                    )

    def _chain(self, seq: int, e: ev.RequestEnqueued, first: bool) -> None:
        """A chain's length belongs to a chain and is 1 or more; a request stays in
        the chain its first enqueue named (readers place it there once)."""
        if e.chain_length is not None and (e.chain is None or e.chain_length < 1):
            self.flag(
                seq,
                f"request_enqueued for {e.request_id} has chain_length {e.chain_length} "
                + ("without a chain" if e.chain is None else "below 1"),
            )
        known = self._requests[e.request_id]
        if first:
            known.chain = e.chain
        elif e.chain != known.chain:
            self.flag(
                seq,
                f"request_enqueued for {e.request_id} names chain {e.chain!r}; its first "
                f"enqueue named {known.chain!r}",
            )

    def _new_attempt(self, rid: str, attempt: int) -> None:
        state = self._requests.get(rid)
        if state is None:
            self._requests[rid] = _Request(attempt)
        elif attempt > state.attempt:
            state.attempt = attempt
            state.terminal_seq = None

    def _dispatched(self, seq: int, rid: str) -> None:
        state = self._requests.get(rid)
        if state is None:
            self.flag(seq, f"request_dispatched for {rid} with no earlier request_enqueued")
        elif state.terminal_seq is not None:
            self.flag(
                seq,
                f"request_dispatched for {rid} after its terminal event "
                f"(seq {state.terminal_seq}) without a new attempt",
            )
        elif state.process != self._process:
            self.flag(
                seq,
                f"request_dispatched for {rid}, which was open before the restart at seq "
                f"{self._restart_seq} and not restored after it (no request_restored)",
            )

    def _restored(self, seq: int, rid: str) -> None:
        state = self._requests.get(rid)
        if state is None:
            self.flag(seq, f"request_restored for {rid} with no earlier request_enqueued")
        elif state.terminal_seq is not None:
            self.flag(
                seq,
                f"request_restored for {rid} after its terminal event (seq {state.terminal_seq})",
            )
        else:
            state.process = self._process

    def _terminal(self, seq: int, event: ev.AnyEvent) -> None:
        rid = ev.request_id_of(event)
        assert rid is not None
        state = self._requests.setdefault(rid, _Request(1))
        if state.terminal_seq is not None:
            self.flag(
                seq,
                f"second terminal event ({ev.type_name(event)}) for {rid} attempt "
                f"{state.attempt}; the first is seq {state.terminal_seq}",
            )
        else:
            state.terminal_seq = seq

    def _swap_ended(self, seq: int, kind: str, model: str) -> None:
        if self._swaps.pop(model, None) is not None:
            return
        if self._state.router is None and self._swaps:
            other = self._swaps.pop(next(iter(self._swaps)))
            self.flag(
                seq,
                f"{kind} for {model} but the swap in progress (seq {other.seq}) "
                f"is to {other.model}",
            )
        else:
            self.flag(seq, f"{kind} for {model} with no swap in progress")


def audit(items: Iterable[tuple[int, ev.AnyEvent]]) -> LogAudit:
    """Check a whole log."""
    result = LogAudit()
    for seq, event in items:
        result.feed(seq, event)
    return result
