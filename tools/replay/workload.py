"""The workload of a recorded log: what arrived, what it cost, and what actually happened.

`extract(path)` reads a gpulane database read-only, in one pass over `events`:

- per request: arrival (first enqueue), priority, model, endpoint, caller, whether
  it is a durable job, the expected run time and deadline its enqueue recorded, the
  GPU time it held once started (`run_ms` of its completion, else started -> end),
  how long it waited for its dispatch if it was dispatched, and, for a request
  cancelled or abandoned while waiting, how long its client waited before leaving;
- per model: the measured load time, and the unload time of a model a swap evicted
  (medians when there are several);
- chains: a request its caller named part of a chain (`X-Gpulane-Chain`, recorded
  with its enqueue) is sent *after* the chain's previous request when it arrived
  once that one had ended, so a what-if run delays it as the real client would have
  (the film scenario's render submits each shot when the previous one finishes).
  A log naming no chain gets a guess from timing instead: a request a caller sent
  within `chain_gap` of its previous request's end, with nothing else of that
  caller open, is linked the same way; a guessed chain of fewer than `MIN_CHAIN`
  requests is taken for a coincidence and unlinked;
- the recorded run itself (`RunResult`), for the first row of every report.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from app.core import events as ev
from app.core.policy import REORDER_REASONS, reorder_reasons
from app.core.residency import Router
from app.core.scoring import NS_PER_S, ScoringParams
from app.core.state import SERIAL
from app.core.wait import wait_ns
from app.store.engine import open_readonly
from app.store.event_store import read_events

DEFAULT_CHAIN_GAP_NS = 5 * NS_PER_S
"""A caller's request sent this soon after its previous one ended continues a chain."""
MIN_CHAIN = 3
"""The fewest requests a guessed chain keeps (shorter ones are unlinked)."""

NS_PER_MS = 1_000_000


@dataclass(slots=True)
class Request:
    """One request of the workload. Times are unix ns; durations ns."""

    request_id: str
    model: str
    priority: int
    arrival_ns: int
    run_ns: int
    """GPU time once started (service time; does not depend on order)."""
    patience_ns: int | None = None
    """Its client gave up after waiting this long (cancelled or abandoned in the queue)."""
    after: int = -1
    """Index of the request this one was sent after (a chain), -1 for none."""
    think_ns: int = 0
    """Gap between the end of `after` and this request's arrival."""
    outcome: str = "completed"
    endpoint: str = "/v1/chat/completions"
    run_estimated: bool = False
    """Never ran in the log (its client left first): `run_ns` is the model's median."""
    caller: str | None = None
    durable: bool = False
    """A durable job (`Prefer: respond-async`): nobody waits on a connection for it."""
    expected_run_ns: int | None = None
    """What its enqueue recorded as its expected run time (None: no history then)."""
    max_wait_ns: int | None = None
    """Its caller's deadline (`X-Gpulane-Max-Wait`): the server cancels it then."""
    chain: str | None = None
    """The chain its caller named (`X-Gpulane-Chain`), the caller's own id."""
    waited_ns: int | None = None
    """In the recorded run: arrival to dispatch, when it was dispatched. Its client
    was still there then, so its patience was at least this."""
    left_by: str | None = None
    """How it left the queue in the recorded run: a cancel reason or 'abandoned'."""
    patience_drawn: bool = False
    """`patience_ns` was drawn by the patience model (`tools.replay.patience`), not
    recorded: a shaken copy draws it again with another seed."""


@dataclass(slots=True)
class SwapTimes:
    """Measured swap costs: a swap from A to B costs unload[A] + load[B]."""

    load_ns: dict[str, int] = field(default_factory=dict)
    unload_ns: dict[str, int] = field(default_factory=dict)
    default_load_ns: int = 0
    default_unload_ns: int = 0
    load_samples: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Every measured load time per model (the medians above are of these)."""
    unload_samples: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def cost(self, from_model: str | None, to_model: str) -> tuple[int, int]:
        """(unload, load) in ns for a swap from `from_model` (None: nothing loaded)."""
        unload = 0 if from_model is None else self.unload_ns.get(from_model, self.default_unload_ns)
        return unload, self.load_ns.get(to_model, self.default_load_ns)

    def sampler(self, seed: int) -> Callable[[str | None, str], tuple[int, int]]:
        """A swap cost that draws each swap's load and unload from the measured ones
        (its model's, else every model's; the median when none was measured), seeded:
        a shaken run's guess at swap times the log measured only as samples (a cold
        load is 2-3x a warm one on the film scenario)."""
        rng = random.Random(seed)
        every_load = tuple(x for xs in self.load_samples.values() for x in xs)
        every_unload = tuple(x for xs in self.unload_samples.values() for x in xs)

        def cost(from_model: str | None, to_model: str) -> tuple[int, int]:
            unload = 0
            if from_model is not None:
                xs = self.unload_samples.get(from_model) or every_unload
                unload = rng.choice(xs) if xs else self.cost(from_model, to_model)[0]
            xs = self.load_samples.get(to_model) or every_load
            load = rng.choice(xs) if xs else self.cost(from_model, to_model)[1]
            return unload, load

        return cost


@dataclass(slots=True)
class RunResult:
    """What one run (recorded or simulated) did to each request, and overall."""

    start_ns: list[int]
    """Per request index: when it started on a loaded model; -1 if it never did."""
    wait_ns: list[int]
    """Per request index: its wait (app/core/wait.py: arrival to dispatch, or to
    the end of one never dispatched, as when it left); -1 while it still waits."""
    end_ns: list[int]
    """Per request index: when it ended after starting; -1 if it never started."""
    arrival_ns: list[int]
    """Per request index: its arrival in this run (chains move with their predecessor)."""
    order: list[int]
    """Request indices in dispatch order."""
    swaps: int = 0
    swap_ns: int = 0
    busy_ns: int = 0
    """Time the GPU was loading or running something."""
    first_ns: int = 0
    last_ns: int = 0
    reorders: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REORDER_REASONS, 0))
    timeline: list[tuple[int, int, str, str]] | None = None
    """(start, end, model, 'swap' | 'run') spans, when asked for (plots)."""


@dataclass(slots=True)
class Workload:
    requests: list[Request]
    """In arrival order."""
    swap_times: SwapTimes
    params: ScoringParams
    """The parameters in force at the end of the log (last `server_started` or
    `config_reloaded`)."""
    scheduler: str = SERIAL
    recorded: RunResult | None = None
    model_priority: dict[str, int] = field(default_factory=dict)
    """fifo: per-model queue priority, as the last `server_started` records it."""
    caller_weights: dict[str, int] = field(default_factory=dict)
    """Fair-share weights, as the last `server_started` records them."""
    router: Router | None = None
    """Which models may be resident together, as the last `server_started` records it."""
    slots: dict[str, int] = field(default_factory=dict)
    """serial: each model's slots as the last `server_started` records them (log format
    4 on; an older serial log ran one request at a time, and has none here)."""
    chains_recorded: bool = False
    """The log names its chains (`X-Gpulane-Chain`): `after` links follow them, and
    nothing is guessed from timing."""

    @property
    def expected_recorded(self) -> bool:
        """Whether the log recorded expected run times at enqueue (a log written
        before they existed, or a generated trace, did not: a simulation then
        learns them from its own completed runs, as the live server does)."""
        return any(r.expected_run_ns is not None for r in self.requests)

    @property
    def models(self) -> list[str]:
        return sorted({r.model for r in self.requests})


# -- reading the log ----------------------------------------------------------


def iter_log(path: str | Path) -> Iterator[tuple[int, ev.AnyEvent]]:
    """(seq, event) of the database at `path`, in seq order, read-only."""
    engine = open_readonly(path)
    try:
        yield from read_events(engine)
    finally:
        engine.dispose()


def extract(path: str | Path, chain_gap_ns: int = DEFAULT_CHAIN_GAP_NS) -> Workload:
    """The workload and the recorded run of the database at `path`."""
    return extract_events(iter_log(path), chain_gap_ns)


@dataclass(slots=True)
class _Seen:
    index: int
    arrival_ns: int
    dispatched_ns: int = -1
    """Its first dispatch (the order, and what its client waited at least)."""
    last_dispatched_ns: int = -1
    """Its last attempt's dispatch; -1 when that attempt was not dispatched."""
    started_ns: int = -1
    ended_ns: int = -1
    run_ns: int | None = None
    outcome: str = "open"
    left_by: str | None = None


def extract_events(
    events: Iterable[tuple[int, ev.AnyEvent]], chain_gap_ns: int = DEFAULT_CHAIN_GAP_NS
) -> Workload:
    requests: list[Request] = []
    seen: dict[str, _Seen] = {}
    order: list[int] = []
    reorders = dict.fromkeys(REORDER_REASONS, 0)
    params = ScoringParams()
    scheduler = SERIAL
    have_params = False
    loads: dict[str, list[int]] = {}
    unloads: dict[str, list[int]] = {}
    model_priority: dict[str, int] = {}
    caller_weights: dict[str, int] = {}
    router: Router | None = None
    slots: dict[str, int] = {}
    open_swap: dict[str, tuple[int, str | None, int]] = {}  # to_model -> (start, from, unload)
    swaps = 0
    swap_ns = 0
    spans: list[tuple[int, int, str, str]] = []
    first_ns: int | None = None
    last_ns = 0

    for _seq, e in events:
        match e:
            case ev.ServerStarted() | ev.ConfigReloaded():
                # A reload's parameters apply from it on, as a start's do.
                p = e if isinstance(e, ev.ServerStarted) else e.parameters
                params = _params_of(p)
                scheduler = p.scheduler
                model_priority = dict(p.model_priority)
                caller_weights = dict(p.caller_weights)
                router = p.router
                slots = (
                    # A held model (a render server) runs one job at a time.
                    {m: n for m, n in p.concurrency.items() if n > 1 and m not in p.held}
                    if p.scheduler == SERIAL and p.log_format >= 4
                    else {}
                )
                have_params = True
            case ev.RequestEnqueued():
                if e.request_id in seen:
                    continue  # a later attempt: arrival, priority and model stay
                arrival = e.enqueued_at if e.enqueued_at is not None else e.at
                seen[e.request_id] = _Seen(len(requests), arrival)
                requests.append(
                    Request(
                        e.request_id,
                        e.model,
                        e.priority,
                        arrival,
                        0,
                        endpoint=e.endpoint,
                        caller=e.caller,
                        durable=e.durable,
                        expected_run_ns=e.expected_run_ns,
                        max_wait_ns=e.max_wait_ns,
                        chain=e.chain,
                    )
                )
                first_ns = arrival if first_ns is None else min(first_ns, arrival)
            case ev.ScoresComputed():
                if not have_params:  # a log without server_started (synthetic, truncated)
                    params = _params_of(e)
                    scheduler = e.scheduler
                    have_params = True
                for reason in reorder_reasons(e):
                    reorders[reason] += 1
            case ev.RequestDispatched():
                s = seen.get(e.request_id)
                if s is not None:
                    s.last_dispatched_ns = e.at
                if s is not None and s.dispatched_ns < 0:
                    s.dispatched_ns = e.at
                    order.append(s.index)
            case ev.RequestRequeued():
                s = seen.get(e.request_id)
                if s is not None:
                    s.last_dispatched_ns = -1
            case ev.SwapStarted():
                swaps += 1
                open_swap[e.to_model] = (e.at, e.from_model, 0)
            case ev.ProcessStopped(reason="evicted") if open_swap:
                # Stopped by a swap in progress (the one it names): its unload part.
                to_model = next(iter(open_swap))
                if e.evicted_for is not None and e.evicted_for in open_swap:
                    to_model = e.evicted_for
                start, frm, unload = open_swap[to_model]
                took = e.at - start
                unloads.setdefault(e.model, []).append(took)
                open_swap[to_model] = (start, frm, max(unload, took))
            case ev.SwapFinished() | ev.SwapFailed():
                took = round(e.duration_ms * NS_PER_MS)
                swap_ns += took
                opened = open_swap.pop(e.model, None)
                if opened is not None:
                    start, _frm, unload = opened
                    spans.append((start, start + took, e.model, "swap"))
                    if isinstance(e, ev.SwapFinished):
                        loads.setdefault(e.model, []).append(max(0, took - unload))
            case ev.RequestStarted():
                s = seen.get(e.request_id)
                if s is not None and s.started_ns < 0:
                    s.started_ns = e.at
            case (
                ev.RequestCompleted()
                | ev.RequestFailed()
                | ev.RequestCancelled()
                | ev.RequestAbandoned()
            ):
                s = seen.get(e.request_id)
                if s is None:
                    continue
                s.ended_ns = e.at
                last_ns = max(last_ns, e.at)
                s.outcome = ev.type_name(e).removeprefix("request_")
                if isinstance(e, ev.RequestCancelled):
                    s.left_by = e.reason
                elif isinstance(e, ev.RequestAbandoned):
                    s.left_by = "abandoned"
                if isinstance(e, ev.RequestCompleted) and e.run_ms is not None:
                    s.run_ns = round(e.run_ms * NS_PER_MS)
                elif s.started_ns >= 0:
                    s.run_ns = e.at - s.started_ns
                elif s.dispatched_ns >= 0:
                    s.run_ns = 0  # ended during its swap
            case _:
                pass

    start_ns = [-1] * len(requests)
    waits = [-1] * len(requests)
    end_ns = [-1] * len(requests)
    busy: list[tuple[int, int]] = [(a, b) for a, b, _, _ in spans]
    for s in seen.values():
        r = requests[s.index]
        r.outcome = s.outcome
        if s.started_ns >= 0:
            start_ns[s.index] = s.started_ns
            end_ns[s.index] = s.ended_ns
        if s.run_ns is not None:
            r.run_ns = s.run_ns
        if s.last_dispatched_ns >= 0 or s.ended_ns >= 0:
            dispatched = s.last_dispatched_ns if s.last_dispatched_ns >= 0 else None
            waits[s.index] = wait_ns(r.arrival_ns, dispatched, s.ended_ns)
        if s.dispatched_ns >= 0:
            r.waited_ns = s.dispatched_ns - r.arrival_ns
        elif s.ended_ns >= 0:
            r.patience_ns = s.ended_ns - r.arrival_ns
            r.left_by = s.left_by
        if s.started_ns >= 0 and s.ended_ns >= 0:
            spans.append((s.started_ns, s.ended_ns, r.model, "run"))
        if s.dispatched_ns >= 0:
            busy.append((s.dispatched_ns, s.ended_ns if s.ended_ns >= 0 else s.dispatched_ns))
    _estimate_unrun(requests, seen)
    chains_recorded = any(r.chain is not None for r in requests)
    if chains_recorded:
        _link_recorded_chains(requests, seen)
    else:
        _link_chains(requests, seen, chain_gap_ns)
    recorded = RunResult(
        start_ns=start_ns,
        wait_ns=waits,
        end_ns=end_ns,
        arrival_ns=[r.arrival_ns for r in requests],
        order=order,
        swaps=swaps,
        swap_ns=swap_ns,
        busy_ns=_union_length(busy),
        first_ns=first_ns or 0,
        last_ns=max(last_ns, first_ns or 0),
        reorders=reorders,
        timeline=sorted(spans),
    )
    return Workload(
        requests=requests,
        swap_times=swap_times_from(loads, unloads),
        params=params,
        scheduler=scheduler,
        recorded=recorded,
        model_priority=model_priority,
        caller_weights=caller_weights,
        router=router,
        slots=slots,
        chains_recorded=chains_recorded,
    )


def _params_of(e: ev.ServerStarted | ev.ScoresComputed) -> ScoringParams:
    return ScoringParams(
        e.aging_divisor_ns, e.swap_affinity_bonus, e.fair_share_bonus, e.short_job_bonus
    )


def swap_times_from(loads: dict[str, list[int]], unloads: dict[str, list[int]]) -> SwapTimes:
    """Per-model medians; a model never measured gets the median over all models."""
    every_load = [x for xs in loads.values() for x in xs]
    every_unload = [x for xs in unloads.values() for x in xs]
    return SwapTimes(
        load_ns={m: int(statistics.median_low(xs)) for m, xs in loads.items()},
        unload_ns={m: int(statistics.median_low(xs)) for m, xs in unloads.items()},
        default_load_ns=int(statistics.median_low(every_load)) if every_load else 0,
        default_unload_ns=int(statistics.median_low(every_unload)) if every_unload else 0,
        load_samples={m: tuple(xs) for m, xs in loads.items()},
        unload_samples={m: tuple(xs) for m, xs in unloads.items()},
    )


def _estimate_unrun(requests: list[Request], seen: dict[str, _Seen]) -> None:
    """A request whose client left before it ran may run in another order: give it the
    median run time of its model and band (else its model, else 0)."""
    by_key: dict[tuple[str, bool], list[int]] = {}
    by_model: dict[str, list[int]] = {}
    for s in seen.values():
        r = requests[s.index]
        if s.started_ns >= 0 and s.outcome == "completed":
            by_key.setdefault((r.model, r.priority >= 50), []).append(r.run_ns)
            by_model.setdefault(r.model, []).append(r.run_ns)
    for s in seen.values():
        if s.dispatched_ns >= 0:
            continue
        r = requests[s.index]
        samples = by_key.get((r.model, r.priority >= 50)) or by_model.get(r.model)
        r.run_ns = int(statistics.median_low(samples)) if samples else 0
        r.run_estimated = True


def _link_recorded_chains(requests: list[Request], seen: dict[str, _Seen]) -> None:
    """Each request of a named chain after the chain's previous one, when it arrived
    once that one had ended (a request sent while its predecessor still ran did
    not wait for it, and keeps its arrival)."""
    ends = {s.index: s.ended_ns for s in seen.values()}
    last_of: dict[tuple[str | None, str], int] = {}  # (caller, chain) -> latest index
    for i, r in enumerate(requests):
        if r.chain is None:
            continue
        key = (r.caller, r.chain)
        prev = last_of.get(key)
        last_of[key] = i
        if prev is None:
            continue
        prev_end = ends.get(prev, -1)
        if prev_end >= 0 and r.arrival_ns >= prev_end:
            r.after = prev
            r.think_ns = r.arrival_ns - prev_end


def _link_chains(requests: list[Request], seen: dict[str, _Seen], gap_ns: int) -> None:
    if gap_ns <= 0:
        return
    ends = {s.index: s.ended_ns for s in seen.values()}
    last_of: dict[str, int] = {}  # caller -> index of its latest request so far
    open_until: dict[str, int] = {}  # caller -> latest end among its requests so far
    for i, r in enumerate(requests):
        if r.caller is None:
            continue
        prev = last_of.get(r.caller)
        if prev is not None:
            prev_end = ends.get(prev, -1)
            latest = open_until[r.caller]
            think = r.arrival_ns - prev_end
            # Sent after its previous request ended, soon after, with nothing else open.
            if prev_end >= 0 and 0 <= think <= gap_ns and latest <= r.arrival_ns:
                r.after = prev
                r.think_ns = think
        end = ends.get(i, -1)
        last_of[r.caller] = i
        open_until[r.caller] = max(open_until.get(r.caller, -1), end if end >= 0 else 1 << 62)
    _drop_short_chains(requests)


def _drop_short_chains(requests: list[Request]) -> None:
    """Unlink every chain of fewer than `MIN_CHAIN` requests: one request sent soon
    after its caller's previous one ended is as likely a coincidence (the film
    scenario's interactive users link one pair on some seeds) as a dependency."""
    succ = {r.after: i for i, r in enumerate(requests) if r.after >= 0}
    for i, r in enumerate(requests):
        if r.after >= 0 or i not in succ:
            continue
        chain = [i]
        while chain[-1] in succ:
            chain.append(succ[chain[-1]])
        if len(chain) < MIN_CHAIN:
            for j in chain[1:]:
                requests[j].after = -1
                requests[j].think_ns = 0


def _union_length(intervals: list[tuple[int, int]]) -> int:
    total = 0
    cur_start = cur_end = None
    for a, b in sorted(intervals):
        if cur_end is None or a > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = a, b
        elif b > cur_end:
            cur_end = b
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total
