"""`explain`: a request's story, recomputed from the event log with the scheduler's own core.

The replay (documented in docs/queries.md, "How explain works"):

1. Start point. Only requests open when the request arrived (its enqueue seq
   E) can compete with it, and every later one arrives after E. So the replay
   starts at S0, the smallest enqueue seq of the requests open at E (found with
   the `requests` read model plus an indexed look for an event after E), or
   at E. Every event from S0 on is folded with `core.state.apply`, as the live
   run loop and recovery do; requests that ended before E are absent and
   apply ignores events about them. The resident/loading model at S0 comes
   from the last `swap_started` or `server_started` before S0 and the swap
   and process events after it; the scheduler and its parameters from the
   last `server_started`, which carries them all, and any `config_reloaded`
   since (a reload's parameters apply from it on). A restart is folded like any
   event: `apply` gives the new process's state, with the jobs its recovery
   put back (`request_restored`; see app/core/state.py for older logs).
   Cost: the events since S0, not the history.
2. At each recorded `scores_computed` while the request waits, `core.policy.decide`
   runs on the replayed state at the recorded time; its ScoresComputed must
   equal the recorded one field for field (`Decision.matches_record`). The
   request's own score is `ScoringParams.breakdown`, as decide computes it,
   and why the winner beat it is read off the terms (`why_won`).
3. Every stretch between two events of the wait is charged to what the GPU
   was doing: a swap, the job running at arrival, or a request dispatched
   ahead (under the reason it won). The stretches partition the wait, so the
   summary adds up to the measured wait exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy
from sqlalchemy import Engine

from app.core import events as ev
from app.core.policy import decide
from app.core.priority import band_of
from app.core.queue import FairKeys, Queued
from app.core.scoring import NS_PER_S, ScoringParams
from app.core.state import SERIAL, SchedulerState, apply
from app.core.swap_costs import SwapCosts, slept_instead
from app.core.wait import time_to_start_ns, wait_ns
from app.report.live_queue import position_of
from app.report.run_times import RunTimes, load_run_times
from app.report.story import (
    CAUSES,
    Ahead,
    Cause,
    ChainPlace,
    Decision,
    Explanation,
    HeldFor,
    Outcome,
    Part,
    Position,
    Reason,
    RunningAtArrival,
    SwapWaited,
)
from app.report.waits import waits_for
from app.store.chains import chain_place
from app.store.event_store import event_rows
from app.store.explain_queries import (
    event_at,
    first_enqueue_open_at,
    last_arrival,
    last_dispatches,
    last_event_before,
    last_swap_seq_before,
    request_row,
    residency_events,
)

CLOCK_SLACK_S = 3600.0
"""How far the wall clock may step back without the start point missing a request."""

_BAND_RANK = {"batch": 0, "normal": 1, "interactive": 2}


def explain(
    engine: Engine,
    request_id: str,
    *,
    now_ns: int | None = None,
    run_times: RunTimes | None = None,
) -> Explanation | None:
    """The story of `request_id`, or None when the database has never seen it.

    `now_ns` is the moment a still-open request is explained as of (default:
    the last event in the log). Everything else comes from the log.
    """
    with engine.connect() as conn:
        row = request_row(conn, request_id)
        if row is None:
            return None
        arrival = last_arrival(conn, request_id)
        if arrival is None:
            return _rejected(row)
        start = replay_start(conn, arrival.seq, arrival.at, row["enqueue_seq"])
        replay = _Replay()
        replay.prime(conn, start)
        story = _Story(replay, request_id, arrival.seq)
        for seq, data in event_rows(conn, after_seq=start - 1):
            if story.feed(seq, ev.decode(data)):
                break
        if story.chain is not None:
            shot, length = chain_place(conn, row["caller"], story.chain, request_id)
            story.chain_place = ChainPlace(story.chain, shot, length)
    as_of = now_ns if now_ns is not None else story.last_event_ns
    if story.phase == "waiting" and run_times is None:
        run_times = load_run_times(engine)
    return story.finish(row, as_of, run_times or RunTimes())


def replay_start(
    conn: sqlalchemy.Connection, arrival_seq: int, arrival_at_s: float, first_enqueue_seq: int
) -> int:
    """S0: the first event the replay must fold for the request arriving at `arrival_seq`."""
    found = first_enqueue_open_at(conn, arrival_seq, arrival_at_s - CLOCK_SLACK_S)
    return min(arrival_seq, first_enqueue_seq, found if found is not None else arrival_seq)


def why_won(
    params: ScoringParams,
    winner: Queued,
    loser: Queued,
    resident: str | None,
    winner_priority: int,
    loser_priority: int,
    fair: FairKeys | None = None,
    expected: Callable[[Queued], int | None] | None = None,
) -> list[Reason]:
    """Why `winner` beat `loser` at a decision, most decisive term first.

    Priority, affinity, fair share and short job are the terms that do not
    change with the wait; when they favour the winner, they won it the pick
    (higher band or tier, swap affinity, ...). When they are equal, the winner
    had waited longer (arrived earlier); when they favour the loser, the winner
    made up the gap by aging. `*_priority` are the header priorities, which name
    the bands; `fair`: the callers' fair-share terms at the decision; `expected`:
    the run time each is scored with (`ScoreQueue.expected`; default: its own,
    as logs before format 3 score). Compared in
    key units, so the answer is exact.
    """
    bonus = params.affinity_key()
    fair = fair or {}
    d_priority = (winner.priority - loser.priority) * params.scale
    d_affinity = (bonus if winner.model == resident else 0) - (
        bonus if loser.model == resident else 0
    )
    d_fair = fair.get(winner.caller, 0) - fair.get(loser.caller, 0)
    if expected is None:
        expected = _own_estimate
    d_short = params.short_job_key(expected(winner)) - params.short_job_key(expected(loser))
    favour: list[Reason] = []
    if d_priority > 0:
        higher = _BAND_RANK[band_of(winner_priority)] > _BAND_RANK[band_of(loser_priority)]
        favour.append("higher_band" if higher else "higher_tier")
    if d_affinity > 0:
        favour.append("swap_affinity")
    if d_fair > 0:
        favour.append("fair_share")
    if d_short > 0:
        favour.append("short_job")
    static = d_priority + d_affinity + d_fair + d_short
    primary: Reason
    if static < 0:
        primary = "aging"
    elif static == 0:
        primary = "arrived_earlier"
    else:
        primary = favour[0]
    return [primary, *(r for r in favour if r != primary)]


# -- the replay ---------------------------------------------------------------


@dataclass
class _Swap:
    from_model: str | None
    to_model: str
    request_id: str | None
    started_ns: int
    finished_ns: int | None = None
    duration_ms: float | None = None
    error: str | None = None
    waited_ns: int = 0
    caller: str | None = None
    evicted: list[str] | None = None
    gpu_memory_mib: int | None = None
    memory_wait_ns: int | None = None
    woke_ms: float | None = None
    slept: list[str] = field(default_factory=list)
    out_of_memory: str | None = None

    def value(self, waited_ns: int | None = None) -> SwapWaited:
        return SwapWaited(
            evicted=self.evicted,
            gpu_memory_mib=self.gpu_memory_mib,
            memory_wait_s=None if self.memory_wait_ns is None else self.memory_wait_ns / NS_PER_S,
            from_model=self.from_model,
            to_model=self.to_model,
            request_id=self.request_id,
            started_at=self.started_ns / NS_PER_S,
            duration_s=None if self.duration_ms is None else self.duration_ms / 1000.0,
            error=self.error,
            waited_s=(self.waited_ns if waited_ns is None else waited_ns) / NS_PER_S,
            caller=self.caller,
            woke_s=None if self.woke_ms is None else self.woke_ms / 1000.0,
            slept=list(self.slept),
            out_of_memory=self.out_of_memory,
        )


@dataclass
class _Holder:
    """A request that held the GPU while the explained one waited."""

    request_id: str
    model: str
    priority: int
    enqueued_ns: int
    dispatched_ns: int | None
    reasons: list[Reason]
    caller: str | None
    held_ns: int = 0


class _Replay:
    """SchedulerState folded with `apply`, plus what reports need and the state lacks:
    dispatch times and the swap in progress."""

    def __init__(self) -> None:
        self.state = SchedulerState()
        self.running_since: dict[str, int] = {}
        self.swap: _Swap | None = None
        self.costs = SwapCosts()
        """Each model's swap costs as the events seen so far teach them."""

    def prime(self, conn: sqlalchemy.Connection, start: int) -> None:
        """Parameters and resident model as of just before seq `start`."""
        server = last_event_before(conn, start)
        last_swap = last_swap_seq_before(conn, start)
        from_seq = max(last_swap or 0, server.seq if server is not None else 0)
        if server is not None and server.seq < from_seq:
            self.feed(ev.decode(server.data))
            # The parameters a reload since then set (a later one is among `events`).
            reload = last_event_before(conn, from_seq, "config_reloaded")
            if reload is not None and reload.seq > server.seq:
                self.feed(ev.decode(reload.data))
        since = (event_at(conn, from_seq) or 0.0) - CLOCK_SLACK_S
        events = list(residency_events(conn, from_seq, start, since))
        started = ev.decode(server.data) if server is not None else None
        if isinstance(started, ev.ServerStarted) and started.peers and server is not None:
            # What was last sent to each peer (its affinity, a choice's order).
            peer_models = {m for pool in started.peers.values() for m in pool.models}
            events += last_dispatches(conn, server.seq, start, peer_models)
            events.sort(key=lambda logged: logged.seq)
        for _seq, data in events:
            self.feed(ev.decode(data))

    def feed(self, event: ev.AnyEvent) -> None:
        match event:
            case ev.ServerStarted():
                # A new process: nothing runs and no swap is in progress in it.
                self.running_since.clear()
                self.swap = None
            case ev.SwapStarted():
                cause = self.state.requests.get(event.request_id or "")
                self.swap = _Swap(
                    event.from_model,
                    event.to_model,
                    event.request_id,
                    event.at,
                    caller=None if cause is None else cause.caller,
                    evicted=event.evicted,
                )
            case ev.SwapFinished() | ev.SwapFailed():
                if self.swap is not None and self.swap.to_model == event.model:
                    self.swap.finished_ns = event.at
                    self.swap.duration_ms = event.duration_ms
                    self.swap.error = event.error if isinstance(event, ev.SwapFailed) else None
                    if isinstance(event, ev.SwapFailed):
                        self.swap.out_of_memory = event.out_of_memory
                    if isinstance(event, ev.SwapFinished):
                        self.swap.gpu_memory_mib = event.gpu_memory_mib
                    self.swap = None
            case ev.MemoryWaitEnded():
                if self.swap is not None and self.swap.to_model == event.model:
                    self.swap.memory_wait_ns = round(event.waited_ms * 1e6)
            case ev.ProcessWoken():
                if self.swap is not None and self.swap.to_model == event.model:
                    self.swap.woke_ms = event.duration_ms
            case ev.ProcessSleeping():
                if self.swap is not None:
                    self.swap.slept.append(
                        slept_instead(event.model, self.costs.costs(event.model))
                    )
            case ev.RequestDispatched():
                if event.request_id in self.state.requests:
                    self.running_since[event.request_id] = event.at
            case ev.RequestEnqueued() | ev.RequestRequeued() | ev.RequestRestored():
                self.running_since.pop(event.request_id, None)
            case _ if isinstance(event, ev.TERMINAL):
                self.running_since.pop(event.request_id, None)
            case _:
                pass
        self.costs.observe(event)
        apply(self.state, event)


class _Story:
    """Follows one request through the replay: arrival, wait, dispatch, end."""

    def __init__(self, replay: _Replay, request_id: str, arrival_seq: int) -> None:
        self.replay = replay
        self.request_id = request_id
        self.arrival_seq = arrival_seq
        self.phase = "before"
        self.last_event_ns = 0
        self.last_t = 0
        self.enqueued_ns = 0
        self.arrived_ns = 0
        self.params = ScoringParams()
        self.scheduler = "serial"
        self.resident_at_arrival: str | None = None
        self.depth_at_arrival = 0
        self.at_arrival: dict[str, _Holder] = {}
        self.ahead: dict[str, _Holder] = {}
        self.swaps: list[_Swap] = []
        self.parts: dict[Cause, int] = dict.fromkeys(CAUSES, 0)
        self.decisions: list[Decision] = []
        self.replay_matches = True
        self.dispatched_ns: int | None = None
        self.own_swap: _Swap | None = None
        self.started_ns: int | None = None
        self.outcome: Outcome | None = None
        self.run_s: float | None = None
        self.requested_priority: int | None = None
        self.priority_ignored: str | None = None
        self.priority_unreadable: str | None = None
        self.failed_loads = 0
        self.lanes = False
        """A router or slots: the wait is charged in the machine's terms (`waits_for`)."""
        self.held: dict[tuple[Cause, str, str | None], int] = {}
        """(slot | drain | evicted, model, for request) -> ns of the wait."""
        self.evicted_by: str | None = None
        """The request whose load evicted its model while it waited."""
        self.callers: dict[str, str | None] = {}
        """Callers of the requests `held` names."""
        self.chain: str | None = None
        """The chain its enqueue names (`X-Gpulane-Chain`)."""
        self.chain_place: ChainPlace | None = None

    # -- events ---------------------------------------------------------------

    def feed(self, seq: int, event: ev.AnyEvent) -> bool:
        """Take the next event; True once the request's story has ended."""
        self.last_event_ns = event.at
        mine = ev.request_id_of(event) == self.request_id
        if mine and isinstance(event, ev.RequestEnqueued):
            self.requested_priority = event.requested_priority
            self.priority_ignored = event.priority_ignored
            self.priority_unreadable = event.priority_unreadable
            self.chain = event.chain
        if self.phase == "before":
            depth = len(self.replay.state.queue)
            self.replay.feed(event)
            if seq == self.arrival_seq:
                self._arrive(event, depth)
            return False
        if self.phase == "waiting":
            self._charge(event.at, restart=isinstance(event, ev.ServerStarted))
            if isinstance(event, ev.ScoresComputed):
                self._decision(seq, event)
            resident = self._resident()
            self.replay.feed(event)
            if (
                resident
                and isinstance(event, ev.RequestDispatched | ev.SwapStarted)
                and event.request_id is not None
                and not self._resident()
            ):
                self.evicted_by = event.request_id  # its model, evicted for this one
                self._note_caller(event.request_id)
            if isinstance(event, ev.SwapStarted) and self.replay.swap is not None:
                self.swaps.append(self.replay.swap)
            if mine and isinstance(event, ev.RequestDispatched):
                self.phase = "running"
                self.dispatched_ns = event.at
                self._join_load()
            elif mine and isinstance(event, ev.TERMINAL):
                self._end(event)
            return self.phase == "done"
        # running: its own swap, start and end
        self.replay.feed(event)
        if isinstance(event, ev.SwapStarted) and event.request_id == self.request_id:
            self.own_swap = self.replay.swap
        elif mine and isinstance(event, ev.RequestStarted):
            self.started_ns = event.at
        elif mine and isinstance(event, ev.TERMINAL):
            self._end(event)
        return self.phase == "done"

    def _arrive(self, event: ev.AnyEvent, depth: int) -> None:
        state = self.replay.state
        request = state.requests.get(self.request_id)
        self.phase = "waiting"
        self.params = state.queue.params
        self.scheduler = state.scheduler
        self.arrived_ns = event.at
        self.enqueued_ns = request.enqueued_ns if request is not None else event.at
        self.parts["earlier_attempts"] = event.at - self.enqueued_ns
        self.last_t = event.at
        self.resident_at_arrival = state.resident
        self.depth_at_arrival = depth
        self.lanes = state.router is not None or (
            state.scheduler == SERIAL and any(state.slots(m) > 1 for m in state.concurrency)
        )
        for rid, model in state.running.items():
            other = state.requests[rid]
            self.at_arrival[rid] = _Holder(
                rid,
                model,
                other.priority,
                other.enqueued_ns,
                self.replay.running_since.get(rid),
                [],
                other.caller,
            )
        if state.loading is not None and self.replay.swap is not None:
            self.swaps.append(self.replay.swap)

    def _charge(self, at: int, *, restart: bool = False) -> None:
        """Charge the time since the previous event to what the GPU was doing
        (`restart`: to the server being down, before a ServerStarted at `at`)."""
        elapsed = at - self.last_t
        start, self.last_t = self.last_t, at
        if restart:
            self.parts["restart"] += elapsed
            return
        state = self.replay.state
        backoff = self._backoff(start, at)
        if backoff:
            # Its model could not load, whatever else the GPU did meanwhile.
            self.parts["load_backoff"] += backoff
            elapsed -= backoff
            if not elapsed:
                return
        if self.lanes:
            lane_cause = self._lane_cause(elapsed)
            if lane_cause is not None:
                self.parts[lane_cause] += elapsed
                return
        cause: Cause = "other"
        if state.loading is not None:
            cause = "swaps"
            if self.replay.swap is not None:
                self.replay.swap.waited_ns += elapsed
        elif state.running:
            rid = min(state.running, key=lambda r: self.replay.running_since.get(r, 0))
            holder = self.at_arrival.get(rid) or self.ahead.get(rid)
            if holder is not None:
                holder.held_ns += elapsed
                cause = holder.reasons[0] if holder.reasons else "running_at_arrival"
        self.parts[cause] += elapsed

    def _resident(self) -> bool:
        """Its model is in use (resident or loading): a lanes story watches for its eviction."""
        state = self.replay.state
        request = state.requests.get(self.request_id)
        return self.lanes and request is not None and request.model in state.in_use

    def _note_caller(self, request_id: str | None) -> None:
        if request_id is not None and request_id not in self.callers:
            other = self.replay.state.requests.get(request_id)
            self.callers[request_id] = None if other is None else other.caller

    def _lane_cause(self, elapsed: int) -> Cause | None:
        """With a router or slots: what this stretch of the wait was for its own
        model (`waits_for`): its load, a free slot, a drain, its model evicted;
        None when it only waited its turn behind higher requests (the causes of
        one lane then say which)."""
        state = self.replay.state
        request = state.requests.get(self.request_id)
        if request is None:
            return None
        model = request.model
        if model in state.loads:
            swap = self.replay.swap
            if swap is not None and swap.to_model == model:
                swap.waited_ns += elapsed
            return "swaps"
        waits = waits_for(state, model)
        key: tuple[Cause, str, str | None]
        if waits.kind == "slot":
            key = ("slot", model, None)
        elif model not in state.in_use and self.evicted_by is not None:
            key = ("evicted", model, self.evicted_by)
        elif waits.kind == "drain":
            key = ("drain", waits.model, waits.for_request)
            self._note_caller(waits.for_request)
        else:
            return None
        self.held[key] = self.held.get(key, 0) + elapsed
        return key[0]

    def _backoff(self, start: int, end: int) -> int:
        """How much of [start, end) its model spent backing off after failed loads."""
        state = self.replay.state
        request = state.requests.get(self.request_id)
        if request is None or request.model in state.in_use:
            return 0
        until = state.backoff_until(request.model)
        if until is None or until <= start or end <= start:
            return 0
        self.failed_loads = state.load_failures[request.model].count
        return min(end, until) - start

    def _decision(self, seq: int, recorded: ev.ScoresComputed) -> None:
        state = self.replay.state
        recomputed = decide(state, recorded.at)
        matches = recomputed is not None and recomputed.scores == recorded
        self.replay_matches &= matches
        mine = state.queue.get(self.request_id)
        winner = state.queue.get(recorded.request_id)
        if mine is None or winner is None:
            self.replay_matches = False
            return
        params = state.queue.params
        fair = state.fair_keys()
        score = state.score(mine, recorded.at, fair)
        won = recorded.request_id == self.request_id
        reasons: list[Reason] = []
        if not won:
            reasons = why_won(
                params,
                winner,
                mine,
                state.resident,
                state.requests[winner.request_id].priority,
                state.requests[self.request_id].priority,
                fair,
                state.queue.expected,
            )
            self.ahead[winner.request_id] = _Holder(
                winner.request_id,
                winner.model,
                state.requests[winner.request_id].priority,
                winner.enqueued_ns,
                recorded.at,
                reasons,
                state.requests[winner.request_id].caller,
            )
        self.decisions.append(
            Decision(
                seq=seq,
                at=recorded.at / NS_PER_S,
                queue_depth=recorded.queue_depth,
                resident=state.resident,
                score=score,
                winner_id=recorded.request_id,
                winner_model=winner.model,
                winner=state.score(winner, recorded.at, fair),
                reason=None if won else reasons[0],
                matches_record=matches,
                winner_caller=state.requests[winner.request_id].caller,
            )
        )

    def _join_load(self) -> None:
        request = self.replay.state.requests.get(self.request_id)
        if request is not None and self.replay.state.loading == request.model:
            self.own_swap = self.replay.swap

    def _end(self, event: ev.AnyEvent) -> None:
        self.phase = "done"
        at = event.at
        match event:
            case ev.RequestCompleted():
                self.outcome = Outcome("completed", at / NS_PER_S, http_status=event.http_status)
                self.run_s = event.run_ms / 1000.0 if event.run_ms is not None else None
            case ev.RequestFailed():
                self.outcome = Outcome(
                    "failed", at / NS_PER_S, http_status=event.http_status, error=event.error
                )
            case ev.RequestCancelled():
                self.outcome = Outcome("cancelled", at / NS_PER_S, cancel_reason=event.reason)
            case _:
                self.outcome = Outcome("abandoned", at / NS_PER_S)
        if self.run_s is None and self.started_ns is not None:
            self.run_s = (at - self.started_ns) / NS_PER_S

    # -- the result -----------------------------------------------------------

    def finish(self, row: Any, as_of_ns: int, times: RunTimes) -> Explanation:
        position: Position | None = None
        until = self.last_t  # its end, when it ended while waiting
        if self.phase == "waiting":
            until = max(as_of_ns, self.last_t)
            self._charge(until)
            position = self._position(until, times)
        wait = wait_ns(self.enqueued_ns, self.dispatched_ns, until)
        started = self.started_ns
        to_start = None if started is None else time_to_start_ns(self.enqueued_ns, started)
        end_ns = max(as_of_ns, self.last_t) if self.outcome is None else self.last_event_ns
        status = {"waiting": "queued", "running": "running"}.get(self.phase)
        if status is None:
            assert self.outcome is not None
            status = self.outcome.status
        return Explanation(
            request_id=self.request_id,
            model=row["model"],
            **request_fields(row, _ARRIVAL_FIELDS),
            status=status,
            as_of=as_of_ns / NS_PER_S,
            arrived_at=self.enqueued_ns / NS_PER_S,
            scheduler=self.scheduler,
            aging_divisor_s=self.params.aging_divisor_ns / NS_PER_S,
            swap_affinity_bonus=self.params.swap_affinity_bonus,
            resident_at_arrival=self.resident_at_arrival,
            queue_depth_at_arrival=self.depth_at_arrival,
            running_at_arrival=[
                RunningAtArrival(
                    request_id=h.request_id,
                    model=h.model,
                    priority=h.priority,
                    band=band_of(h.priority),
                    since=None if h.dispatched_ns is None else h.dispatched_ns / NS_PER_S,
                    held_s=h.held_ns / NS_PER_S,
                    caller=h.caller,
                    render=h.model in self.replay.state.held,
                )
                for h in self.at_arrival.values()
            ],
            decisions=self.decisions,
            ahead=[
                Ahead(
                    request_id=h.request_id,
                    model=h.model,
                    priority=h.priority,
                    band=band_of(h.priority),
                    arrived_at=h.enqueued_ns / NS_PER_S,
                    dispatched_at=(h.dispatched_ns or 0) / NS_PER_S,
                    reason=h.reasons[0],
                    reasons=h.reasons,
                    held_s=h.held_ns / NS_PER_S,
                    caller=h.caller,
                )
                for h in self.ahead.values()
            ],
            swaps=[s.value() for s in self.swaps],
            dispatched_at=None if self.dispatched_ns is None else self.dispatched_ns / NS_PER_S,
            wait_s=wait / NS_PER_S,
            wait=[
                Part(cause, ns / NS_PER_S, 100.0 * ns / wait if wait else 0.0)
                for cause, ns in self.parts.items()
                if ns
            ],
            own_swap=None if self.own_swap is None else self.own_swap.value(0),
            started_at=None if self.started_ns is None else self.started_ns / NS_PER_S,
            time_to_start_s=None if to_start is None else to_start / NS_PER_S,
            run_s=self.run_s,
            outcome=self.outcome,
            waiting=position,
            total_s=(end_ns - self.enqueued_ns) / NS_PER_S,
            replay_matches=self.replay_matches,
            requested_priority=self.requested_priority,
            priority_ignored=self.priority_ignored,
            priority_unreadable=self.priority_unreadable,
            chain=self.chain_place,
            failed_loads=self.failed_loads,
            held_for=[
                HeldFor(
                    cause=cause,
                    model=model,
                    request_id=rid,
                    seconds=ns / NS_PER_S,
                    caller=None if rid is None else self.callers.get(rid),
                )
                for (cause, model, rid), ns in self.held.items()
            ],
        )

    def _position(self, now_ns: int, times: RunTimes) -> Position | None:
        replay = self.replay
        found = position_of(replay.state, replay.running_since, now_ns, times, self.request_id)
        return None if found is None else live_position(found, now_ns)


_ARRIVAL_FIELDS = ("model_requested", "endpoint", "caller", "priority", "band", "attempt")
"""What an explanation copies from the request's row, whatever became of it."""


def request_fields(row: Any, names: Sequence[str]) -> dict[str, Any]:
    """The columns `names` of a request's read-model row (`requests`), as the
    fields of a view of it: an explanation here, a job's view (app/jobs/job_view.py)."""
    return {name: row[name] for name in names}


def live_position(found: tuple[int, int, int, bool], now_ns: int) -> Position:
    """A `Position` from `live_queue.position_of`'s answer."""
    position, depth, start, behind_open = found
    return Position(
        position=position,
        queue_depth=depth,
        estimated_start_at=start / NS_PER_S,
        estimated_start_in_s=(start - now_ns) / NS_PER_S,
        estimated_start_open=behind_open,
    )


def _rejected(row: Any) -> Explanation:
    """A request refused at admission: it never queued."""
    at_s = float(row["enqueued_at"])
    return Explanation(
        request_id=row["id"],
        model=None,
        **request_fields(row, _ARRIVAL_FIELDS),
        status="rejected",
        as_of=at_s,
        arrived_at=at_s,
        scheduler="",
        aging_divisor_s=0.0,
        swap_affinity_bonus=0,
        outcome=Outcome("rejected", at_s, http_status=row["http_status"], error=row["error"]),
    )


def _own_estimate(q: Queued) -> int | None:
    return q.expected_run_ns
