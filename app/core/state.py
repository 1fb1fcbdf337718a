"""Scheduler state and the one `apply` that folds events into it.

The live run loop, crash recovery, `explain` and the replay tool all build their
state with `apply`, so a log always means the same thing to each of them. Folding
the whole log from scratch into `SchedulerState()` gives the state the server had.

A `server_started` is a new process: its parameters (scheduler, agingDivisor,
swapAffinityBonus, fairShareBonus, shortJobBonus, caller weights, fifo priorities
and limits, the router) replace the old ones, nothing is loaded, loading or running, and every
caller's attained service starts again from 0. Its load back-off settings
(`app.core.load_backoff`; absent before them: none) apply from it, and no model
has failed loads yet. A `swap_failed` adds one to its model's failed loads in a
row, a `swap_finished` ends them. An `out_of_memory` on a `swap_failed` or a
`process_stopped` puts its model in `ran_out` (`residency.RanOut`) until a load
measures it or a reload declares it another size.

Residency: `residents` (loaded and ready) and `loads` (in progress, one per lane)
may hold several models when `server_started.router` says they may be resident
together. A dispatch that swaps commits its load at once: the models the router
evicts for it leave `residents` (its `swap_started` names them again; a log
before routers names none there, meaning every other model in use), and the
target is loading. With no router (every log before routers), a finished load
leaves its model the only resident one: the fold is the one-model fold of before.

What is queued then is what recovery puts back:
- `log_format` 4 (this version): as 3, and under `serial` a model runs up to its
  `concurrency` (`concurrencyLimit`, default 1) requests at once (`slots`); a
  serial log of an older format ran one at a time, whatever `concurrency` it
  recorded (fifo's default 10 was recorded for every model).
- `log_format` 3: as 2, and the short-job term is one per (model,
  endpoint), from the estimate of its latest enqueue (`app.core.queue`); in
  formats 1 and 2 it is each request's own, fixed at its enqueue.
- `log_format` 2: the queue starts empty and each `request_restored`
  after it puts one job back; their order is the tie-break order, and a job that
  was running is re-queued (`request_requeued`) right after its own restore, so
  it keeps its arrival place (an older recovery re-queued it after all of them;
  its logs fold as written).
- `log_format` 1 (logs written before): recovery recorded nothing, so the fold
  does what it did: the open durable requests stay, queued, in order of first
  arrival, with their attempt and enqueue time; the synchronous ones are dropped
  (their `request_abandoned` follows). Format-1 logs do not carry fifo priorities
  or limits: a fifo log of that format folds with priority 0 and the default limit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import msgspec

from app.core import events as ev
from app.core.load_backoff import NO_BACKOFF, LoadBackoff, LoadFailures
from app.core.peers import PeerPool, affine
from app.core.queue import NO_FAIR, FairKeys, Queued, ScoreQueue
from app.core.residency import MemoryRouter, MemoryView, RanOut, Router, to_evict
from app.core.scoring import Breakdown, ScoringParams

# Scheduler names and fifo's per-model limit, owned here so the config (which
# imports the core, never the reverse) validates against the same values.
SERIAL: Final = "serial"
FIFO: Final = "fifo"
SCHEDULERS: Final = (SERIAL, FIFO)
DEFAULT_CONCURRENCY_LIMIT: Final = 10
SERIAL_CONCURRENCY_LIMIT: Final = 1
"""Serial's default `concurrencyLimit`: one request at a time, the size-1 lane."""


def default_concurrency(scheduler: str) -> int:
    """A model's `concurrencyLimit` when its config leaves it unset (or 0)."""
    return DEFAULT_CONCURRENCY_LIMIT if scheduler == FIFO else SERIAL_CONCURRENCY_LIMIT


class OpenRequest(msgspec.Struct):
    """A request that is queued or running."""

    request_id: str
    model: str
    priority: int
    """The header's priority; the fifo queue adds the model's priority to it."""
    enqueued_ns: int
    durable: bool
    attempt: int
    running: bool = False
    caller: str | None = None
    """Its caller's label, for the live queue, per-caller metrics and fair share."""
    expected_run_ns: int | None = None
    max_wait_ns: int | None = None
    dispatched_ns: int | None = None
    endpoint: str = ""
    """Its endpoint: the short-job term is per (model, endpoint) from log format 3."""
    """When its current attempt was dispatched: the start of what its caller is charged."""
    progress: tuple[int, int, int] | None = None
    """The current attempt's last `request_progressed`: (done, total, at ns)."""


class SchedulerState:
    """Everything a decision depends on. Mutated only by `apply`."""

    def __init__(
        self,
        params: ScoringParams | None = None,
        *,
        scheduler: str = SERIAL,
        model_priority: Mapping[str, int] | None = None,
        concurrency: Mapping[str, int] | None = None,
        config_hash: str = "",
        caller_weights: Mapping[str, int] | None = None,
        log_format: int = ev.LOG_FORMAT,
        router: Router | None = None,
        load_backoff: LoadBackoff = NO_BACKOFF,
    ) -> None:
        self._reset(
            params or ScoringParams(),
            scheduler,
            model_priority,
            concurrency,
            config_hash,
            caller_weights,
            log_format,
            router,
            load_backoff,
        )

    def _reset(
        self,
        params: ScoringParams,
        scheduler: str,
        model_priority: Mapping[str, int] | None,
        concurrency: Mapping[str, int] | None,
        config_hash: str,
        caller_weights: Mapping[str, int] | None = None,
        log_format: int = ev.LOG_FORMAT,
        router: Router | None = None,
        load_backoff: LoadBackoff = NO_BACKOFF,
    ) -> None:
        """A new process's state: these parameters, nothing queued, loaded or running.
        `log_format` 3 on: the short-job term is per (model, endpoint), from the
        estimate of its latest enqueue; before: per request, from its own (see
        `app.core.queue`)."""
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be 'serial' or 'fifo', not {scheduler!r}")
        self.scheduler = scheduler
        self.params = params
        self.model_priority = dict(model_priority or {})
        self.concurrency = dict(concurrency or {})
        self._slot_counts: dict[str, int] = {}
        """`slots` per model asked so far (what it reads is fixed until the next reset)."""
        self.held: frozenset[str] = frozenset()
        """Models whose jobs hold them until their end is learnt: one at a time."""
        self._log_format = log_format
        self._serial_slots = scheduler == SERIAL and log_format >= 4
        """Serial runs up to `concurrency[model]` at once from log format 4; before,
        one (older serial logs record fifo's default 10 there, unused)."""
        self.config_hash = config_hash
        # fifo orders by priority then arrival: no aging and no bounded terms.
        queue_params = params if scheduler == SERIAL else ScoringParams(0, 0)
        self.queue = ScoreQueue(queue_params, short_by_lane=log_format >= 3)
        self.requests: dict[str, OpenRequest] = {}
        """Insertion order is first arrival: a re-queue keeps a request's place here."""
        self.running: dict[str, str] = {}
        """request id -> model, for dispatched requests not yet finished."""
        self._running_by_model: dict[str, int] = {}
        """model -> how many of `running` are on it (absent: none)."""
        self.router = router
        """Which models may be resident together (None: one at a time)."""
        self.residents: dict[str, None] = {}
        """The resident set: models loaded and ready, in the order they became so."""
        self.loads: dict[str, str | None] = {}
        """Loads in progress (at most one per lane): model -> the request it was
        dispatched for (None: a preload), in the order they began."""
        self.in_use: frozenset[str] = frozenset()
        """`residents` and `loads` together: the models whose requests get the
        swap-affinity bonus, and what `to_evict` weighs a load against."""
        self.next_order = 0
        self.caller_weights = dict(caller_weights or {})
        self._weights = {c: max(1, w) for c, w in self.caller_weights.items()}
        """Caller label -> the weight its GPU time is divided by (at least 1)."""
        self._fair = self.queue.params.fair_share_bonus != 0
        self.attained: dict[str | None, int] = {}
        """Each caller's attained service: GPU time charged, in ns / its weight
        (kept only while fair share is on; a returning caller starts from its own)."""
        self.open_by_caller: dict[str | None, int] = {}
        """Callers with queued or running requests (how many): the active ones."""
        self._active_attained: dict[str | None, int] = {}
        """`attained` of the active callers only: what every decision reads."""
        self._fair_keys: FairKeys | None = None
        """`fair_keys()` as of the last change to `_active_attained` (None: to compute)."""
        self._most_attained = 0
        """The most of any caller's `attained` (it only grows): kept, not
        searched for, when a caller arrives at an idle server."""
        self.asleep: frozenset[str] = frozenset()
        """Models whose server sleeps (`process_slept`, until it is woken or stops):
        not resident; a load of one is a wake, which estimates count at its cost."""
        self.waking: frozenset[str] = frozenset()
        """Loads in progress that woke their model (`process_woken`, until the
        load's `swap_finished`): what the run loop learns as a wake, not a load."""
        self.load_backoff = load_backoff
        self.load_failures: dict[str, LoadFailures] = {}
        """Models whose last loads failed: how many in a row, the last one's time
        and error (`swap_failed`); a `swap_finished` ends the series."""
        self.measured_mib: dict[str, int] = {}
        """Footprints measured in this process (`gpu_memory_mib` of `swap_finished`,
        `process_stopping`, `process_stopped`): the memory router's sizes."""
        self.load_cost_ns: dict[str, int] = (
            dict(router.load_ns) if isinstance(router, MemoryRouter) else {}
        )
        """Each model's last load time (`swap_finished`; before any, the memory
        router's from the log): what evicting it costs."""
        self.last_used: dict[str, int] = {}
        """When each model last ended a request or a load (unix ns)."""
        self.others_mib = 0
        """GPU memory processes gpulane does not own hold (`gpu_memory_seen`)."""
        self.ran_out: dict[str, RanOut] = {}
        """Models whose server ran out of GPU memory since a load last measured them."""
        self._set_peers(None, None)

    @property
    def resident(self) -> str | None:
        """The model that became ready last (with one lane, the one resident)."""
        return next(reversed(self.residents), None)

    @property
    def loading(self) -> str | None:
        """The load begun last (with one lane, the one in progress)."""
        return next(reversed(self.loads), None)

    def snapshot(self) -> SchedulerState:
        """A copy for a reader that works in slices while this state moves on (the
        live queue view): the queue and every container copied, O(n) at C speed."""
        copy = object.__new__(SchedulerState)
        for name, value in vars(self).items():
            setattr(copy, name, value.copy() if isinstance(value, dict | list | set) else value)
        copy.queue = self.queue.snapshot()
        return copy

    def backoff_until(self, model: str) -> int | None:
        """When `model` may load again after its failed loads (unix ns); None
        when it has no failure in a row or no back-off is set."""
        failures = self.load_failures.get(model)
        if failures is None:
            return None
        delay = self.load_backoff.delay_ns(failures.count)
        return failures.last_ns + delay if delay else None

    def backing_off(self, now_ns: int) -> frozenset[str]:
        """The models that may not load at `now_ns`: their back-off runs. A
        model in use (loaded again by a reload or a preload) is not held back."""
        if not self.load_failures or not self.load_backoff.first_ns:
            return _NONE
        return frozenset(
            model
            for model in self.load_failures
            if model not in self.in_use and (self.backoff_until(model) or 0) > now_ns
        )

    @property
    def shared_lane(self) -> bool:
        """Whether co-resident models run one job at a time (the memory router's
        default): a model may start only while no other one runs or loads."""
        router = self.router
        return isinstance(router, MemoryRouter) and not router.side_by_side

    def lane_taken(self, model: str) -> bool:
        """Under a shared lane, whether another local model runs or loads now."""
        if not self.shared_lane:
            return False
        for other in (*self._running_by_model, *self.loads):
            if other != model and other not in self.peer_of:
                return True
        return False

    def memory_view(self) -> MemoryView:
        """What the memory router weighs besides sizes, from this state."""
        return MemoryView(
            measured_mib=self.measured_mib,
            costs_ns=self.load_cost_ns,
            last_used_ns=self.last_used,
            needed=frozenset(m for m, n in self.queue.waiting_by_model().items() if n),
            busy=frozenset(self._running_by_model).union(self.loads),
            others_mib=self.others_mib,
            ran_out=self.ran_out.keys(),
        )

    def alone_after_out_of_memory(self, model: str) -> RanOut | None:
        """Under the memory router, why a load of `model` now makes room as if it
        needed the whole budget (`swap_started.ran_out`); None: it does not."""
        return self.ran_out.get(model) if isinstance(self.router, MemoryRouter) else None

    def to_evict(self, target: str, resident: frozenset[str]) -> frozenset[str]:
        """`residency.to_evict` under this state's router; the memory router also
        weighs this state's measured sizes, load costs, use and waiting requests."""
        if isinstance(self.router, MemoryRouter):
            return to_evict(self.router, target, resident, self.memory_view())
        return to_evict(self.router, target, resident)

    def _set_peers(
        self, peers: Mapping[str, PeerPool] | None, choices: Mapping[str, Iterable[str]] | None
    ) -> None:
        """`server_started.peers` and `.peer_choices` (`app.core.peers`)."""
        self.peer_pools = dict(peers or {})
        self.peer_of = {m: peer for peer, pool in self.peer_pools.items() for m in pool.models}
        """A peer's model entry -> the peer."""
        self.choices = {name: tuple(entries) for name, entries in (choices or {}).items()}
        """A bare id several peers serve -> the entries its requests may go to."""
        self.last_sent: dict[str, str] = {}
        """Peer -> the model entry last dispatched to it."""
        self.last_target: dict[str, str] = {}
        """Choice -> the entry its last request was dispatched to."""
        self.affine = self.in_use
        """The models whose requests get the swap-affinity bonus: `in_use`, but of
        a peer's models only the one last sent to it (`peers.affine`)."""

    def _peer_dispatched(self, choice: str | None, target: str) -> None:
        peer = self.peer_of.get(target)
        if peer is None:
            return
        self.last_sent[peer] = target
        if choice is not None:
            self.last_target[choice] = target
        self._affinity_changed()

    def _affinity_changed(self) -> None:
        if not self.peer_of:
            self.affine = self.in_use
            return
        self.affine = affine(self.in_use, self.peer_of, self.last_sent, self.last_target)

    def has_free_slot(self, model: str) -> bool:
        """Whether `model` may start one more request: its own slots, or for a
        peer's model the peer's, shared by all its models."""
        peer = self.peer_of.get(model)
        if peer is None:
            slots = self._slot_counts.get(model)
            if slots is None:
                slots = self.slots(model)
            return self._running_by_model.get(model, 0) < slots
        pool = self.peer_pools[peer]
        return sum(self.running_on(m) for m in pool.models) < pool.slots

    def running_on(self, model: str) -> int:
        return self._running_by_model.get(model, 0)

    def busy(self, model: str) -> bool:
        """Running requests, or loading: a model that cannot be evicted now."""
        return model in self._running_by_model or model in self.loads

    def any_busy(self, models: frozenset[str]) -> bool:
        """Whether any of `models` is `busy`."""
        return not models.isdisjoint(self._running_by_model) or not models.isdisjoint(self.loads)

    def occupied(self) -> frozenset[str]:
        """The models in use and those with running requests: what a load is
        weighed against (`residency.to_evict`)."""
        if self._running_by_model.keys() <= self.in_use:
            return self.in_use
        return self.in_use.union(self._running_by_model)

    def _set_running(self, request_id: str, model: str) -> None:
        if self.running.get(request_id) is None:
            self._running_by_model[model] = self._running_by_model.get(model, 0) + 1
        self.running[request_id] = model

    def _pop_running(self, request_id: str) -> str | None:
        model = self.running.pop(request_id, None)
        if model is not None:
            left = self._running_by_model[model] - 1
            if left:
                self._running_by_model[model] = left
            else:
                del self._running_by_model[model]
        return model

    def _residency_changed(self) -> None:
        self.in_use = frozenset(self.residents).union(self.loads)
        self._affinity_changed()

    def slots(self, model: str) -> int:
        """How many requests `model` may run at once: its `concurrencyLimit` as
        `server_started` recorded it (absent: fifo's default 10, serial's 1).
        Serial logs before format 4 ran one at a time whatever they recorded. A
        held model (`server_started.held`: a render server) runs one job at a
        time: each holds it until its end is learnt, and the next waits."""
        slots = self._slot_counts.get(model)
        if slots is None:
            if model in self.held:
                slots = 1
            elif self.scheduler == FIFO:
                slots = self.concurrency.get(model, DEFAULT_CONCURRENCY_LIMIT)
            elif self._serial_slots:
                slots = max(1, self.concurrency.get(model, SERIAL_CONCURRENCY_LIMIT))
            else:
                slots = 1
            self._slot_counts[model] = slots
        return slots

    def fair_keys(self) -> FairKeys:
        """Each active caller's fair-share term in key units, from its attained
        service against the least and most served active callers (read with
        `.get(caller, 0)`: a caller whose term is 0 may be left out)."""
        active = self._active_attained
        if not self._fair or len(active) < 2:
            return NO_FAIR  # one caller alone has had no less than anyone: no term
        keys = self._fair_keys
        if keys is None:
            # Several decisions may read it between changes (arrivals of active
            # callers change nothing): computed once for them.
            keys = self._fair_keys = self.queue.params.fair_share_keys(active)
        return keys

    def score(self, q: Queued, now_ns: int, fair: FairKeys | None = None) -> Breakdown:
        """A waiting request's score at `now_ns`, term by term, as the next decision
        would see it (`fair`: `fair_keys()`, passed in when scoring many)."""
        fair_key = (self.fair_keys() if fair is None else fair).get(q.caller, 0)
        return self.queue.params.breakdown(
            q.priority,
            q.enqueued_ns,
            now_ns,
            q.model in self.affine,
            expected_run_ns=self.queue.expected(q),
            fair_key=fair_key if self.queue.params.fair_share_bonus else 0,
        )

    def _enqueue(self, request: OpenRequest) -> None:
        request.running = False
        request.dispatched_ns = None
        if request.request_id not in self.requests:
            # The caller's request opens. A caller with nothing open before is
            # lifted to the least attained service of the active callers (or, when
            # none is active, the most of any), so time spent idle is not banked.
            caller = request.caller
            count = self.open_by_caller.get(caller, 0)
            if count == 0 and self._fair:
                attained, active = self.attained, self._active_attained
                floor = min(active.values()) if active else self._most_attained
                attained[caller] = active[caller] = max(attained.get(caller, 0), floor)
                self._fair_keys = None
            self.open_by_caller[caller] = count + 1
        self.requests[request.request_id] = request
        self.queue.push(
            Queued(
                request_id=request.request_id,
                model=request.model,
                priority=self.queue_priority(request.model, request.priority),
                enqueued_ns=request.enqueued_ns,
                order=self.next_order,
                caller=request.caller,
                expected_run_ns=request.expected_run_ns,
                endpoint=request.endpoint,
            )
        )
        self.next_order += 1

    def _reconfigure(self, p: ev.ServerStarted, config_hash: str) -> None:
        """A reload (`config_reloaded`): its parameters apply from the next decision.
        What is open, running, loaded and attained stays; the waiting requests are
        queued again under the new terms in their arrival order, keeping their
        places on ties and the short-job estimates learnt so far."""
        if p.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be 'serial' or 'fifo', not {p.scheduler!r}")
        params = ScoringParams(
            p.aging_divisor_ns, p.swap_affinity_bonus, p.fair_share_bonus, p.short_job_bonus
        )
        waiting = sorted(self.queue, key=lambda q: q.order)
        estimates = self.queue.estimates()
        self.scheduler = p.scheduler
        self.params = params
        self.model_priority = dict(p.model_priority)
        self.concurrency = dict(p.concurrency)
        self._slot_counts = {}
        self.held = frozenset(p.held)
        self._serial_slots = p.scheduler == SERIAL and self._log_format >= 4
        self.config_hash = config_hash
        queue_params = params if p.scheduler == SERIAL else ScoringParams(0, 0)
        self.queue = ScoreQueue(queue_params, short_by_lane=self._log_format >= 3)
        for (model, endpoint), expected in estimates.items():
            self.queue.note_estimate(model, endpoint, expected)
        for q in waiting:
            request = self.requests[q.request_id]
            priority = self.queue_priority(request.model, request.priority)
            self.queue.push(msgspec.structs.replace(q, priority=priority))
        if isinstance(self.router, MemoryRouter):  # what the log told it stays known
            for model, mib in self.router.measured_mib.items():
                self.measured_mib.setdefault(model, mib)
        sizes = [
            r.declared_mib if isinstance(r, MemoryRouter) else {} for r in (self.router, p.router)
        ]
        for model in [m for m in self.ran_out if sizes[0].get(m) != sizes[1].get(m)]:
            del self.ran_out[model]  # a size declared anew is trusted again
        self.router = p.router
        if isinstance(p.router, MemoryRouter):
            for model, ns in p.router.load_ns.items():
                self.load_cost_ns.setdefault(model, ns)
        self.caller_weights = dict(p.caller_weights)
        self._weights = {c: max(1, w) for c, w in self.caller_weights.items()}
        fair = self.queue.params.fair_share_bonus != 0
        if fair and not self._fair:  # attained service counts from here
            self._active_attained = {c: self.attained.get(c, 0) for c in self.open_by_caller}
        self._fair = fair
        self._fair_keys = None
        self.load_backoff = LoadBackoff(
            p.load_backoff_ns, p.load_backoff_max_ns, p.load_failure_limit
        )
        self._set_peers(p.peers, p.peer_choices)
        self._affinity_changed()

    def queue_priority(self, model: str, priority: int) -> int:
        """The priority a request for `model` queues at: the granted one, to which
        fifo adds the model's priority (the one place that rule lives)."""
        if self.scheduler == FIFO:
            return priority + self.model_priority.get(model, 0)
        return priority

    def newcomer(
        self,
        model: str,
        priority: int,
        now_ns: int,
        *,
        caller: str | None = None,
        expected_run_ns: int | None = None,
        endpoint: str = "",
    ) -> Queued:
        """A request arriving now as the queue would hold it, not queued: after
        every request already there on equal scores. What admission's bounds and
        `Retry-After` estimate for a request before it is admitted."""
        return Queued(
            request_id="",
            model=model,
            priority=self.queue_priority(model, priority),
            enqueued_ns=now_ns,
            order=self.next_order,
            caller=caller,
            expected_run_ns=expected_run_ns,
            endpoint=endpoint,
        )

    def _charge(self, request: OpenRequest, at: int) -> None:
        """Charge a running request's caller the GPU time since its dispatch
        (run and any swap it caused), divided by the caller's weight."""
        since = request.dispatched_ns
        if since is None or not self._fair:
            return
        request.dispatched_ns = None
        if at > since:
            caller = request.caller
            weight = self._weights.get(caller or "", 1)
            # Charged while open (before its finish closes it), so it is active.
            served = self.attained.get(caller, 0) + (at - since) // weight
            self.attained[caller] = self._active_attained[caller] = served
            self._fair_keys = None
            if served > self._most_attained:
                self._most_attained = served

    def _finish(self, request_id: str, at: int | None = None) -> None:
        if self._pop_running(request_id) is None:
            self.queue.remove(request_id)  # a running request is no longer queued
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if at is not None:
            self._charge(request, at)
            if request.running:
                self.last_used[request.model] = at
        count = self.open_by_caller[request.caller] - 1
        if count:
            self.open_by_caller[request.caller] = count
        else:
            del self.open_by_caller[request.caller]
            if self._active_attained.pop(request.caller, None) is not None:
                self._fair_keys = None


def apply(state: SchedulerState, event: ev.AnyEvent) -> None:
    """Fold one event into the state. Events about unknown requests are ignored,
    because recovery loads only open requests, not the whole history."""
    # A dict lookup, not `match`: replay folds millions of events, and a class
    # pattern chain costs one isinstance per case tried.
    _HANDLERS.get(type(event), _ignored)(state, event)


def fold_for(event_type: type[ev.AnyEvent]) -> Callable[[SchedulerState, Any], None]:
    """`apply` for events of one type, looked up once: a replay folds millions
    of events of a few types."""
    return _HANDLERS.get(event_type, _ignored)


def _ignored(state: SchedulerState, event: Any) -> None:
    """Events that change no state (`scores_computed`, `request_started`,
    `lease_acquired`, ...)."""


def _enqueued(state: SchedulerState, event: Any) -> None:
    """Queue the request an enqueue or restore event describes (replacing any
    earlier record of it). A restore always carries its first `enqueued_at`."""
    enqueued_ns = event.enqueued_at if event.enqueued_at is not None else event.at
    if event.request_id in state.requests:
        state._finish(event.request_id)
    state.queue.note_estimate(event.model, event.endpoint, event.expected_run_ns)
    state._enqueue(
        OpenRequest(
            request_id=event.request_id,
            model=event.model,
            priority=event.priority,
            enqueued_ns=enqueued_ns,
            durable=event.durable,
            attempt=event.attempt,
            caller=event.caller,
            expected_run_ns=event.expected_run_ns,
            max_wait_ns=event.max_wait_ns,
            endpoint=event.endpoint,
        )
    )


def _dispatched(state: SchedulerState, event: Any) -> None:
    if state.peer_of:  # known request or not: explain folds only the last of these
        state._peer_dispatched(event.choice, event.model)
    request = state.requests.get(event.request_id)
    if request is None:
        return
    state.queue.remove(event.request_id)
    request.running = True
    request.attempt = event.attempt
    request.dispatched_ns = event.at
    request.progress = None
    if event.swap:
        # The swap is committed from this moment, before SwapStarted is
        # recorded: what it evicts takes no more work (the decision found it
        # idle), and requests for the incoming model join this load.
        if state.router is None:
            state.residents.clear()  # one model at a time: every other one goes
        else:
            for model in state.to_evict(event.model, state.occupied()):
                state.residents.pop(model, None)
            state.residents.pop(event.model, None)
        state.loads[event.model] = event.request_id
        state._residency_changed()
    state._set_running(event.request_id, event.model)


def _progressed(state: SchedulerState, event: Any) -> None:
    request = state.requests.get(event.request_id)
    if request is not None and request.running and event.total > 0:
        request.progress = (event.done, event.total, event.at)


def _requeued(state: SchedulerState, event: Any) -> None:
    request = state.requests.get(event.request_id)
    if request is None:
        return
    state._pop_running(event.request_id)
    state.queue.remove(event.request_id)
    state._charge(request, event.at)
    request.attempt = event.attempt
    state._enqueue(request)


def _swap_started(state: SchedulerState, event: Any) -> None:
    # What it evicts leaves the resident set now (its process_stopping follows);
    # a log before routers names nothing: every other model in use was evicted.
    target = event.to_model
    if event.evicted is None:
        state.residents.clear()
        request = state.loads.get(target, event.request_id)
        state.loads.clear()
    else:
        for model in event.evicted:
            state.residents.pop(model, None)
            state.loads.pop(model, None)
        state.residents.pop(target, None)
        request = state.loads.pop(target, event.request_id)
    state.loads[target] = request
    state._residency_changed()


def _swap_finished(state: SchedulerState, event: Any) -> None:
    state.load_failures.pop(event.model, None)  # a load that works ends the series
    if event.gpu_memory_mib is not None:  # measured: its size is known again
        state.ran_out.pop(event.model, None)
    _measured(state, event)
    state.load_cost_ns[event.model] = round(event.duration_ms * 1e6)
    state.last_used[event.model] = event.at
    if event.model in state.waking:
        state.waking = state.waking - {event.model}
    if state.router is None:
        state.residents.clear()  # one model at a time
    state.residents[event.model] = None
    state.loads.pop(event.model, None)
    state._residency_changed()


def _swap_failed(state: SchedulerState, event: Any) -> None:
    _ran_out(state, event)
    if event.model in state.waking:
        state.waking = state.waking - {event.model}
    before = state.load_failures.get(event.model)
    state.load_failures[event.model] = LoadFailures(
        count=1 if before is None else before.count + 1, last_ns=event.at, error=event.error
    )
    state.loads.pop(event.model, None)
    state.residents.pop(event.model, None)
    state._residency_changed()


def _process_stopped(state: SchedulerState, event: Any) -> None:
    _ran_out(state, event)
    _measured(state, event)
    _not_resident(state, event)


def _ran_out(state: SchedulerState, event: Any) -> None:
    """Its server ran out of GPU memory (`out_of_memory`; a `process_stopping` has
    none), beside what else was in use."""
    if getattr(event, "out_of_memory", None) is not None:
        beside = sorted(m for m in state.occupied() if m != event.model and m not in state.peer_of)
        state.ran_out[event.model] = RanOut(beside=beside, loading=event.model in state.loads)


def _not_resident(state: SchedulerState, event: Any) -> None:
    """A stop, a sleep, or a sleep or wake skipped: the model is not resident, and
    not asleep either (a sleep is `process_slept`)."""
    if state.residents.pop(event.model, 1) is None:
        state._residency_changed()
    if event.model in state.asleep:
        state.asleep = state.asleep - {event.model}


def _slept(state: SchedulerState, event: Any) -> None:
    state.asleep = state.asleep | {event.model}


def _woken(state: SchedulerState, event: Any) -> None:
    state.asleep = state.asleep - {event.model}
    state.waking = state.waking | {event.model}


def _gpu_memory_seen(state: SchedulerState, event: Any) -> None:
    state.others_mib = event.others_mib


def _measured(state: SchedulerState, event: Any) -> None:
    """A footprint measured (`gpu_memory_mib`): the memory router's size of it."""
    if event.gpu_memory_mib is not None:
        state.measured_mib[event.model] = event.gpu_memory_mib


def _ended(state: SchedulerState, event: Any) -> None:
    state._finish(event.request_id, event.at)


def _config_reloaded(state: SchedulerState, event: Any) -> None:
    state._reconfigure(event.parameters, event.config_hash)


def _server_started(state: SchedulerState, event: Any) -> None:
    # The fold rule is in the module docstring. Leftover upstreams are stopped by
    # recovery, so nothing is loaded.
    kept = [] if event.log_format >= 2 else [r for r in state.requests.values() if r.durable]
    state._reset(
        ScoringParams(
            event.aging_divisor_ns,
            event.swap_affinity_bonus,
            event.fair_share_bonus,
            event.short_job_bonus,
        ),
        event.scheduler,
        event.model_priority,
        event.concurrency,
        event.config_hash,
        event.caller_weights,
        event.log_format,
        event.router,
        LoadBackoff(event.load_backoff_ns, event.load_backoff_max_ns, event.load_failure_limit),
    )
    if event.peers or event.peer_choices:
        state._set_peers(event.peers, event.peer_choices)
    state.held = frozenset(event.held)
    for request in kept:
        state._enqueue(request)


_NONE: frozenset[str] = frozenset()

_HANDLERS: dict[type, Callable[[SchedulerState, Any], None]] = {
    ev.ConfigReloaded: _config_reloaded,
    ev.RequestEnqueued: _enqueued,
    ev.RequestDispatched: _dispatched,
    ev.RequestRequeued: _requeued,
    ev.RequestProgressed: _progressed,
    ev.RequestRestored: _enqueued,
    ev.SwapStarted: _swap_started,
    ev.SwapFinished: _swap_finished,
    ev.SwapFailed: _swap_failed,
    ev.ProcessStopping: _process_stopped,  # not resident from the moment the stop begins
    ev.ProcessStopped: _process_stopped,
    ev.ProcessSleeping: _not_resident,  # asleep is not resident, as stopping is not
    ev.ProcessSlept: _slept,
    ev.ProcessWoken: _woken,
    ev.SleepSkipped: _not_resident,  # a sleeper whose wake failed sleeps no more
    ev.RequestCompleted: _ended,
    ev.RequestFailed: _ended,
    ev.RequestCancelled: _ended,
    ev.RequestAbandoned: _ended,
    ev.ServerStarted: _server_started,
    ev.GpuMemorySeen: _gpu_memory_seen,
}
