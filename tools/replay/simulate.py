"""Discrete-event re-run of a workload on the server's own core (`apply`, `decide`).

The simulation is a run loop with a simulated clock: every arrival, cancel, swap and
completion is the event the live server would record, folded into a `SchedulerState`
with `app.core.state.apply`, and every dispatch is whatever `app.core.policy.decide`
returns at that moment (`choose` when nothing is recorded: the same dispatch
without the `scores_computed` that explains it). Nothing here scores or orders
requests; that is what makes a replay honest.

Every enqueue carries what the live server's would: the request's caller, and its
expected run time, the recorded one when the log has them, else what a
`RunEstimates` fed with this run's own completed runs expects at that moment (how
the server learns it). A client leaves the queue at its patience (`patience_ns`,
see `tools.replay.patience`) and the server cancels a request at its deadline
(`max_wait_ns`, reason `deadline`), whichever comes first.

The GPU: a request holds it for its measured run time once its model is loaded; a
swap from A to B costs unload[A] + load[B] (measured medians). Under the `fifo`
scheduler several requests of one model may be in flight; they share the GPU
(processor sharing), so the total work is the same in every order.

Several lanes and slots (`serial` with a router, or a model with more than one slot:
`Policy.router`, `Policy.slots`, as `server_started` carries them): the same core
decides (`choose` starts every request the dispatch rule lets start, in score order,
at each moment), and the simulator keeps one clock per running request and per load.
A request sharing its model's slots runs its recorded run time, unaffected by its
neighbours, times (1 + `slot_slowdown` x the requests already running on its model
when it starts): 0 by default, which is what a log recorded with the same slots
already measured (its run times include the sharing). A load that evicts several
models waits for the slowest of their unloads; loads in different lanes overlap.

The state is built as every reader of a log builds it: by folding a `server_started`
that carries the policy's scheduler and parameters (`started_event`). With `record`,
that event and every later one are also appended to a list (in time order once
sorted by `at`): that is how `generate` writes a plausible log.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from heapq import heappop, heappush

from app.core import events as ev
from app.core.policy import Choice, Decision, cannot_start, choose, decide, pick_reasons
from app.core.priority import band_of
from app.core.residency import Router, one_at_a_time
from app.core.run_estimate import RunEstimates
from app.core.scoring import ScoringParams
from app.core.state import FIFO, SERIAL, SchedulerState, apply, fold_for
from app.core.wait import wait_ns
from tools.replay.workload import Request, RunResult, Workload

SwapCost = Callable[[str | None, str], tuple[int, int]]
"""(from_model, to_model) -> (unload_ns, load_ns)."""

_INF = 1 << 126
# Kinds of pending steps; at the same moment they happen in this order.
_DEADLINE = 0
_CANCEL = 1
_ARRIVAL = 2
# How a request that left the queue in the log ends if it runs here.
_LEFT = ("cancelled", "abandoned")
# `apply` for the steps' most frequent events, its dispatch on type done once.
_fold_enqueued = fold_for(ev.RequestEnqueued)
_fold_dispatched = fold_for(ev.RequestDispatched)
_fold_completed = fold_for(ev.RequestCompleted)
_fold_swap_started = fold_for(ev.SwapStarted)
_fold_swap_finished = fold_for(ev.SwapFinished)


@dataclass(frozen=True, slots=True)
class Policy:
    """One way of scheduling: a scheduler, its parameters, and a label for reports."""

    label: str
    params: ScoringParams = field(default_factory=ScoringParams)
    scheduler: str = SERIAL
    ignore_priority: bool = False
    """Enqueue every request at priority 0 (strict arrival order with bonus 0, no aging)."""
    concurrency: int = 1
    """fifo: requests in flight per model; they share the GPU."""
    model_priority: tuple[tuple[str, int], ...] = ()
    """fifo: per-model queue priority added to the header's."""
    kind: str = "simulated"
    """'simulated' (a parameter set) or 'reference' (a policy to compare against)."""
    caller_weights: tuple[tuple[str, int], ...] = ()
    """Fair-share weight of each caller (absent: 1), as `server_started` carries them."""
    router: Router | None = None
    """Which models may be resident together (`routing.router`; None: one at a time)."""
    slots: tuple[tuple[str, int], ...] = ()
    """serial: each model's `concurrencyLimit`, its slots (absent: 1)."""
    slot_slowdown: float = 0.0
    """A request starting beside k others on its model runs x (1 + this x k)."""

    @property
    def lanes(self) -> bool:
        """Whether this serial run needs the several-lane loop (a router, or slots)."""
        return self.router is not None or any(n > 1 for _, n in self.slots)


def simulate(
    workload: Workload,
    policy: Policy,
    *,
    timeline: bool = False,
    record: list[ev.AnyEvent] | None = None,
    swap_cost: SwapCost | None = None,
    started: ev.ServerStarted | None = None,
) -> RunResult:
    """Run `workload` under `policy`; `record` collects the events a server would log.
    `started`: the `server_started` the run begins with (default `started_event`)."""
    if started is None:
        first = min((r.arrival_ns for r in workload.requests), default=0)
        started = started_event(policy, {r.model for r in workload.requests}, first)
    sim = _Sim(workload, policy, timeline, record, swap_cost or workload.swap_times.cost, started)
    return sim.run()


def started_event(
    policy: Policy,
    models: Iterable[str],
    at: int,
    *,
    version: str = "replay",
    config_hash: str = "",
    pid: int = 0,
) -> ev.ServerStarted:
    """The `server_started` of a server running `policy` on `models`."""
    limit = max(1, policy.concurrency)
    concurrency = dict.fromkeys(sorted(models), limit)
    if policy.scheduler == SERIAL:
        concurrency.update(policy.slots)
    return ev.ServerStarted(
        at=at,
        version=version,
        config_hash=config_hash,
        scheduler=policy.scheduler,
        aging_divisor_ns=policy.params.aging_divisor_ns,
        swap_affinity_bonus=policy.params.swap_affinity_bonus,
        pid=pid,
        model_priority=dict(policy.model_priority),
        concurrency=concurrency,
        log_format=ev.LOG_FORMAT,
        fair_share_bonus=policy.params.fair_share_bonus,
        short_job_bonus=policy.params.short_job_bonus,
        caller_weights=dict(policy.caller_weights),
        router=policy.router,
    )


class _Sim:
    """One run. Three loops (one lane, several lanes, fifo's shared GPU) differ in
    how they keep time and what runs at once; every request arrives, is dispatched,
    starts, swaps and ends through the same steps (below the loops)."""

    def __init__(
        self,
        workload: Workload,
        policy: Policy,
        timeline: bool,
        record: list[ev.AnyEvent] | None,
        swap_cost: SwapCost,
        started: ev.ServerStarted,
    ) -> None:
        self.reqs = workload.requests
        self.policy = policy
        self.state = SchedulerState()
        apply(self.state, started)
        if record is not None:
            record.append(started)
        self.record = record
        # Unrecorded, the scores that explain a decision are not worth building.
        self.ask: Callable[[SchedulerState, int], Choice | None] = (
            choose if record is None else decide
        )
        self.swap_cost = swap_cost
        self.ignore_priority = policy.ignore_priority
        # Slots are serial's; fifo's requests in flight share the GPU instead.
        self.slowdown = policy.slot_slowdown if self.state.scheduler == SERIAL else 0.0
        n = len(self.reqs)
        self.result = RunResult(
            start_ns=[-1] * n,
            wait_ns=[-1] * n,
            end_ns=[-1] * n,
            arrival_ns=[r.arrival_ns for r in self.reqs],
            order=[],
            timeline=[] if timeline else None,
        )
        self.index = {r.request_id: i for i, r in enumerate(self.reqs)}
        self.succ: dict[int, int] = {}
        for i, r in enumerate(self.reqs):
            if r.after >= 0:
                self.succ[r.after] = i
        roots = [i for i, r in enumerate(self.reqs) if r.after < 0]
        roots.sort(key=lambda i: self.reqs[i].arrival_ns)
        self.roots = roots
        # Their arrival times, and _INF past the last: `root_t[k]` is always the next one.
        self.root_t = [self.reqs[i].arrival_ns for i in roots] + [_INF]
        # (time, kind, index): cancels and chains, over a step that never comes, so
        # the next one is always `pending[0]`.
        self.pending: list[tuple[int, int, int]] = [(_INF, _ARRIVAL, -1)]
        # Requests dispatched or cancelled: their pending patience and deadline
        # steps are stale (the one-lane loop drops them without a step of their own).
        self.gone = bytearray(n)
        self.bands: dict[int, str] = {}
        # Swap events as a log before routers has them (no `evicted`): the one-lane
        # and fifo loops; the several-lane loop sets it False.
        self.one_lane_log = True
        # The swap in progress (one lane, fifo).
        self.loading: str | None = None
        self.load_end = _INF
        self.load_waiters: list[int] = []
        self.swap_took = 0
        # fifo: jobs started and sharing the GPU (index -> remaining work, ns at full rate).
        self.active: dict[int, float] = {}
        self.last_t = 0
        self.busy_since = -1
        self.gpu_next = _INF
        self.pids: dict[str, int] = {}
        self.next_pid = 40_000
        # Expected run times: recorded, else learnt from this run's completions.
        self.estimates = None if workload.expected_recorded else RunEstimates()

    def run(self) -> RunResult:
        res = self.result
        if self.roots:
            res.first_ns = self.reqs[self.roots[0]].arrival_ns
        if self.state.scheduler == SERIAL and self.policy.lanes and not self._one_lane():
            last = self._run_lanes()
        elif self.state.scheduler == SERIAL:
            last = self._run_serial()
        else:
            last = self._run_shared()
        res.last_ns = max(last, res.first_ns)
        if self.record is not None:
            self.record.sort(key=lambda e: e.at)  # stable: same-time events keep their order
        return res

    def _one_lane(self) -> bool:
        """Whether this run's router and slots allow one request at a time on one
        model at a time: then the one-lane loop decides exactly as the several-lane
        loop would, at a fraction of the cost (it asks the core only when the GPU
        is free). Not when recording: the one-lane loop writes the swap events of
        a log before routers (no `evicted`)."""
        if self.record is not None or self.result.timeline is not None:
            return False
        state = self.state
        models = {r.model for r in self.reqs}
        return all(state.slots(m) == 1 for m in models) and one_at_a_time(state.router, models)

    # -- serial: one request on the GPU (the hot path) -----------------------------

    def _run_serial(self) -> int:
        state = self.state
        res = self.result
        pending = self.pending
        roots = self.roots
        gone = self.gone
        root_t = self.root_t
        arrive, dispatch, start, complete = (
            self._arrive,
            self._dispatch,
            self._start,
            self._complete,
        )
        ask = self.ask
        k = 0
        now = res.first_ns
        run_i = -1
        run_end = _INF
        load_end = _INF  # mirrors self.load_end, read on every step
        busy = 0
        while True:
            t = root_t[k]
            while pending[0][0] < t:
                _, kind, i = pending[0]
                if kind == _ARRIVAL or not gone[i]:
                    t = pending[0][0]
                    break
                heappop(pending)
            if run_end < t:
                t = run_end
            elif load_end < t:
                t = load_end
            if t == _INF:
                break
            now = t
            if load_end == now:
                load_end = _INF
                run_i = self._end_swap(now)[0]
                run_end = now + start(run_i, now)
                busy += run_end - now
            if run_end == now:
                run_end = _INF
                complete(run_i, now)
            while True:
                if pending[0][0] == now:
                    _, kind, i = heappop(pending)
                    if kind == _ARRIVAL:
                        arrive(i, now)
                    elif not gone[i]:
                        gone[i] = 1
                        self._cancel(i, now, kind)
                elif root_t[k] == now:
                    arrive(roots[k], now)
                    k += 1
                else:
                    break
            # While the GPU is taken decide() returns nothing: skip the call. With
            # nothing running or loading, the open requests are the queued ones.
            if run_end != _INF or load_end != _INF or not state.requests:
                continue
            decision = ask(state, now)
            if decision is None:
                continue
            i = dispatch(decision)
            if decision.action == "swap":
                took = self._swap(i, decision.dispatched.model, now, decision.evicted)
                busy += took
                load_end = now + took
                continue
            run_i = i
            run_end = now + start(i, now)
            busy += run_end - now
        res.busy_ns = busy
        if res.timeline is not None:
            res.timeline.sort()
        return now

    # -- serial with lanes and slots: several loads and runs at once -------------------

    def _run_lanes(self) -> int:
        self.one_lane_log = False
        state = self.state
        pending = self.pending
        root_t = self.root_t
        params = state.queue.params
        fair = params.fair_share_bonus != 0
        short = params.short_job_bonus != 0
        noted: dict[tuple[str, str], int] = {}
        """With the short-job term: the estimate each (model, endpoint) was last
        enqueued with, as the queue notes it (`ScoreQueue.note_estimate`)."""
        settled = False
        """The last decision found nothing to start, and only arrivals that cannot
        start either have happened since (`policy.cannot_start`): skip the next."""
        # (end, kind, index or model): 0 a load ends (its model), 1 a run ends.
        clocks: list[tuple[int, int, int, str]] = [(_INF, 9, -1, "")]
        loads: dict[str, tuple[int, list[int]]] = {}  # model -> (took, waiters)
        active = 0  # loads and runs in progress: the GPU is busy while > 0
        k = 0
        now = self.result.first_ns
        while True:
            t = root_t[k]
            if pending[0][0] < t:
                t = pending[0][0]
            if clocks[0][0] < t:
                t = clocks[0][0]
            if t == _INF:
                break
            if active and t > now:
                self.result.busy_ns += t - now
            now = t
            while clocks[0][0] == now:
                settled = False
                _, kind, i, model = heappop(clocks)
                active -= 1
                if kind == 1:
                    self._complete(i, now)
                    continue
                took, waiters = loads.pop(model)
                event = ev.SwapFinished(at=now, model=model, duration_ms=took / 1e6)
                _fold_swap_finished(state, event)
                if self.record is not None:
                    self.record.append(event)
                for w in waiters:
                    # Not when its client left during the load.
                    if self.reqs[w].request_id in state.running:
                        heappush(clocks, (now + self._start(w, now), 1, w, ""))
                        active += 1
            while True:
                if pending[0][0] == now:
                    _, kind, i = heappop(pending)
                    if kind != _ARRIVAL:
                        if self._cancel(i, now, kind):
                            settled = False
                        continue
                elif root_t[k] == now:
                    i = self.roots[k]
                    k += 1
                else:
                    break
                enqueued = self._arrive(i, now)
                expected = enqueued.expected_run_ns
                if short and expected is not None:
                    lane = (enqueued.model, enqueued.endpoint)
                    if noted.get(lane) != expected:
                        noted[lane] = expected
                        settled = False  # its model's short-job term moved
                if settled and (
                    (fair and state.open_by_caller[enqueued.caller] == 1)  # every fair term moved
                    or not cannot_start(state, enqueued.model)
                ):
                    settled = False
            if settled:
                continue
            settled = True  # the loop below ends when nothing more can start
            while state.queue:
                decision = self.ask(state, now)
                if decision is None:
                    break
                i = self._dispatch(decision)
                model = decision.dispatched.model
                action = decision.action
                if action == "run":
                    heappush(clocks, (now + self._start(i, now), 1, i, ""))
                    active += 1
                elif action == "swap":
                    took = self._swap(i, model, now, decision.evicted)
                    loads[model] = (took, [i])
                    heappush(clocks, (now + took, 0, -1, model))
                    active += 1
                else:
                    loads[model][1].append(i)
        return now

    # -- fifo: several requests of one model in flight, sharing the GPU ------------

    def _run_shared(self) -> int:
        state = self.state
        pending = self.pending
        k = 0
        now = self.result.first_ns
        while True:
            t = self.root_t[k]
            if pending[0][0] < t:
                t = pending[0][0]
            if self.gpu_next < t:
                t = self.gpu_next
            if t == _INF:
                break
            now = t
            while self.gpu_next == now:
                self._gpu_event(now)
            while True:
                if pending[0][0] == now:
                    _, kind, i = heappop(pending)
                    if kind == _ARRIVAL:
                        self._arrive(i, now)
                    else:
                        self._cancel(i, now, kind)
                elif self.root_t[k] == now:
                    self._arrive(self.roots[k], now)
                    k += 1
                else:
                    break
            while state.queue:
                decision = self.ask(state, now)
                if decision is None:
                    break
                i = self._dispatch(decision)
                if decision.action == "swap":
                    self._swap(i, decision.dispatched.model, now, decision.evicted)
                    self._gpu_changed(now)
                elif decision.action == "join":
                    self.load_waiters.append(i)  # joins the load in progress
                else:
                    self._start_shared(i, now)
        return now

    def _gpu_event(self, now: int) -> None:
        if self.load_end == now:
            for i in self._end_swap(now):
                self._start_shared(i, now)
        self._progress(now)
        active = self.active
        n = len(active)
        for i in [i for i, left in active.items() if left * n < 0.5]:
            del active[i]
            self._complete(i, now)
        self._gpu_changed(now)

    def _start_shared(self, i: int, now: int) -> None:
        run_ns = self._start(i, now)
        self._progress(now)
        self.active[i] = float(run_ns)
        self._gpu_changed(now)

    def _progress(self, now: int) -> None:
        active = self.active
        if active and now > self.last_t:
            step = (now - self.last_t) / len(active)
            for i in active:
                active[i] -= step
        self.last_t = now

    def _gpu_changed(self, now: int) -> None:
        active = self.active
        nxt = self.load_end
        if active:
            done = self.last_t + math.ceil(min(active.values()) * len(active))
            if done < nxt:
                nxt = done
        self.gpu_next = nxt
        if active or self.loading is not None:
            if self.busy_since < 0:
                self.busy_since = now
        elif self.busy_since >= 0:
            self.result.busy_ns += now - self.busy_since
            self.busy_since = -1

    # -- the steps every loop takes ------------------------------------------------

    def _arrive(self, i: int, now: int) -> ev.RequestEnqueued:
        """Request `i` arrives: its enqueue, folded (and recorded), and its patience
        and deadline pending."""
        r = self.reqs[i]
        # A chained request arrives after its predecessor's end, wherever that is in
        # this run; a root at its recorded arrival, the value already there.
        self.result.arrival_ns[i] = now
        band = self.bands.get(r.priority)
        if band is None:
            band = self.bands[r.priority] = band_of(r.priority)
        estimates = self.estimates
        event = ev.RequestEnqueued(
            at=now,
            request_id=r.request_id,
            model=r.model,
            model_requested=r.model,
            endpoint=r.endpoint,
            priority=0 if self.ignore_priority else r.priority,
            band=band,
            durable=r.durable,
            caller=r.caller,
            expected_run_ns=r.expected_run_ns
            if estimates is None
            else estimates.expected(r.model, r.endpoint),
            max_wait_ns=r.max_wait_ns,
        )
        _fold_enqueued(self.state, event)
        if self.record is not None:
            self.record.append(event)
        if r.patience_ns is not None:
            heappush(self.pending, (now + r.patience_ns, _CANCEL, i))
        if r.max_wait_ns is not None:
            heappush(self.pending, (now + r.max_wait_ns, _DEADLINE, i))
        return event

    def _dispatch(self, decision: Choice) -> int:
        """The core's decision taken: its reorders counted, its events folded (and,
        a `Decision`, recorded with the scores that explain it); the request's index."""
        pick = decision.pick
        winner = pick.winner
        # Most picks are nobody's reorder: skip building the reasons.
        if (
            pick.without_aging is not winner
            or pick.without_affinity is not winner
            or pick.without_fair_share is not winner
            or pick.without_short_job is not winner
        ):
            reorders = self.result.reorders
            for reason in pick_reasons(pick):
                reorders[reason] += 1
        dispatched = decision.dispatched
        if self.record is not None:
            assert isinstance(decision, Decision)  # what `ask` returns when recording
            self.record.append(decision.scores)  # apply() ignores it: it changes no state
            self.record.append(dispatched)
        _fold_dispatched(self.state, dispatched)
        i = self.index[dispatched.request_id]
        res = self.result
        res.wait_ns[i] = wait_ns(res.arrival_ns[i], dispatched.at, dispatched.at)
        self.gone[i] = 1
        self.result.order.append(i)
        return i

    def _start(self, i: int, now: int) -> int:
        """Request `i` starts on its loaded model; how long it runs."""
        r = self.reqs[i]
        if self.record is not None:
            self.record.append(ev.RequestStarted(at=now, request_id=r.request_id))
        self.result.start_ns[i] = now
        run_ns = r.run_ns
        if self.slowdown:
            beside = self.state.running_on(r.model) - 1  # dispatched on it, this one aside
            if beside:
                run_ns = round(run_ns * (1 + self.slowdown * beside))
        return run_ns

    def _complete(self, i: int, now: int) -> None:
        """Request `i`'s run ends as it ended in the log: its terminal event, folded
        (and recorded); the next request of its chain pending."""
        r = self.reqs[i]
        res = self.result
        res.end_ns[i] = now
        if res.timeline is not None:
            res.timeline.append((res.start_ns[i], now, r.model, "run"))
        rid = r.request_id
        outcome = r.outcome
        event: ev.AnyEvent
        if outcome == "completed" or (outcome != "failed" and outcome not in _LEFT):
            run_ms = r.run_ns / 1e6
            event = ev.RequestCompleted(at=now, request_id=rid, http_status=200, run_ms=run_ms)
            _fold_completed(self.state, event)
            if self.estimates is not None:
                # As the server learns it: from the completion's run_ms.
                self.estimates.observe(r.model, r.endpoint, int(run_ms * 1e6))
        elif outcome == "failed":
            event = ev.RequestFailed(at=now, request_id=rid, error="failed in the recorded run")
            apply(self.state, event)
        else:
            event = ev.RequestCancelled(at=now, request_id=rid, reason="client_gone")
            apply(self.state, event)
        if self.record is not None:
            self.record.append(event)
        self._chain(i, now)

    def _cancel(self, i: int, now: int, kind: int) -> bool:
        """Cancel a waiting request at its patience or deadline; False when it was
        no longer waiting (nothing changed)."""
        r = self.reqs[i]
        if r.request_id not in self.state.queue:
            return False  # dispatched before its client would have left, or already gone
        reason: ev.CancelReason = "deadline" if kind == _DEADLINE else "client_gone"
        event = ev.RequestCancelled(at=now, request_id=r.request_id, reason=reason)
        apply(self.state, event)
        res = self.result
        res.wait_ns[i] = wait_ns(res.arrival_ns[i], None, now)  # never dispatched: until it left
        if self.record is not None:
            self.record.append(event)
        self._chain(i, now)
        return True

    def _chain(self, i: int, now: int) -> None:
        """Request `i` has ended: the next request of its chain, if any, arrives
        after its think time."""
        nxt = self.succ.get(i)
        if nxt is not None:
            heappush(self.pending, (now + self.reqs[nxt].think_ns, _ARRIVAL, nxt))

    def _swap(self, i: int, model: str, now: int, evicted: frozenset[str]) -> int:
        """SwapStarted for request `i`'s load of `model`, evicting `evicted` (all
        idle; one lane: the resident model, if any), and, recorded, the processes'
        events; returns its duration: the slowest unload, then the load. One lane
        and fifo also keep it as the swap in progress."""
        routed = not self.one_lane_log
        if routed:
            names = sorted(evicted)
            first = names[0] if names else None
        else:
            # A log before routers names the one model a swap leaves (`from_model`).
            first = min(evicted) if evicted else None
            names = [] if first is None else [first]
        unload, load = self.swap_cost(first, model)
        for other in names[1:]:
            unload = max(unload, self.swap_cost(other, model)[0])
        rid = self.reqs[i].request_id
        event = ev.SwapStarted(
            at=now,
            from_model=first if len(names) == 1 else None,
            to_model=model,
            request_id=rid,
            evicted=names if routed else None,
        )
        _fold_swap_started(self.state, event)
        record = self.record
        if record is not None:
            record.append(event)
            for frm in names:
                record.append(
                    ev.ProcessStopped(
                        at=now + unload,
                        model=frm,
                        pid=self.pids.get(frm, 0),
                        reason="evicted",
                        exit_code=0,
                        evicted_for=model if routed else None,
                        evicted_by=rid if routed else None,
                    )
                )
            self.next_pid += 1
            self.pids[model] = self.next_pid
            cmdline = ["llama-server", "--model", model]
            record.append(
                ev.ProcessStarted(at=now + unload, model=model, pid=self.next_pid, cmdline=cmdline)
            )
        took = unload + load
        res = self.result
        res.swaps += 1
        res.swap_ns += took
        if res.timeline is not None:
            res.timeline.append((now, now + took, model, "swap"))
        if not routed:
            self.loading = model
            self.swap_took = took
            self.load_end = now + took
            self.load_waiters = [i]
        return took

    def _end_swap(self, now: int) -> list[int]:
        """SwapFinished of the swap in progress (one lane, fifo); returns the requests
        that waited for it."""
        model = self.loading
        assert model is not None
        event = ev.SwapFinished(at=now, model=model, duration_ms=self.swap_took / 1e6)
        _fold_swap_finished(self.state, event)
        if self.record is not None:
            self.record.append(event)
        self.loading = None
        self.load_end = _INF
        waiters, self.load_waiters = self.load_waiters, []
        return waiters


# -- perturbed workloads (--shake) ---------------------------------------------


def shaken(workload: Workload, seed: int, noise: float) -> Workload:
    """A copy with run and think times scaled by 1 +/- `noise` and arrivals moved by up
    to `noise` of the median gap between arrivals, from a seeded generator; and what
    the replay had to estimate drawn again: a request that never ran in the log gets
    the run time of a random completed request of its model and band (instead of
    their median). (Swap times are drawn per swap by `SwapTimes.sampler`, patience by
    `patience.with_patience` with another seed.)"""
    rng = random.Random(seed)
    arrivals = sorted(r.arrival_ns for r in workload.requests)
    gaps = sorted(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))
    jitter = noise * (gaps[len(gaps) // 2] if gaps else 0)
    uniform = rng.uniform
    ran: dict[tuple[str, bool], list[int]] = {}
    by_model: dict[str, list[int]] = {}
    for r in workload.requests:
        if not r.run_estimated and r.outcome == "completed":
            ran.setdefault((r.model, r.priority >= 50), []).append(r.run_ns)
            by_model.setdefault(r.model, []).append(r.run_ns)
    out: list[Request] = []
    for r in workload.requests:
        run_ns = r.run_ns
        if r.run_estimated:
            samples = ran.get((r.model, r.priority >= 50)) or by_model.get(r.model)
            if samples:
                run_ns = rng.choice(samples)
        out.append(
            replace(
                r,
                arrival_ns=r.arrival_ns + round(uniform(-jitter, jitter)),
                run_ns=max(0, round(run_ns * (1 + uniform(-noise, noise)))),
                think_ns=max(0, round(r.think_ns * (1 + uniform(-noise, noise)))),
            )
        )
    # Arrival order may change; chains keep pointing at the same requests.
    return replace(workload, requests=out, recorded=None)


def reference_policies(
    workload: Workload, params: ScoringParams, fifo_concurrency: int
) -> list[Policy]:
    """What the score is compared against: arrival order, priority alone, llama-swap fifo
    (the serial ones on the recorded router and slots)."""
    slots = tuple(sorted(workload.slots.items()))
    return [
        Policy(
            "arrival order",
            ScoringParams(0, 0),
            ignore_priority=True,
            kind="reference",
            router=workload.router,
            slots=slots,
        ),
        Policy(
            "priority, no aging",
            ScoringParams(0, params.swap_affinity_bonus),
            kind="reference",
            router=workload.router,
            slots=slots,
        ),
        Policy(
            f"fifo (x{fifo_concurrency})",
            ScoringParams(0, 0),
            scheduler=FIFO,
            concurrency=fifo_concurrency,
            model_priority=tuple(sorted(workload.model_priority.items())),
            kind="reference",
            router=workload.router,
        ),
    ]
