"""What `explain` returns: a request's story as frozen values (JSON for the API, text for the CLI).

Times are unix seconds (REAL, as in the tables), durations seconds. Field by
field in docs/queries.md ("Explain a request").
"""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

from app.core.scoring import Breakdown

Reason = Literal[
    "higher_band",
    "higher_tier",
    "swap_affinity",
    "fair_share",
    "short_job",
    "aging",
    "arrived_earlier",
]
"""Why a request dispatched ahead won its decision, most decisive term first."""

Cause = Literal[
    "running_at_arrival",
    Reason,  # the winner of a decision ahead held the GPU
    "swaps",
    "slot",  # its model was resident with every slot taken (`held_for` names it)
    "drain",  # a model drained before its request could start (`held_for` names it, and for whom)
    "evicted",  # its model was evicted for another request while it waited (`held_for`)
    "load_backoff",  # its model backed off after failed loads (app/core/load_backoff.py)
    "restart",
    "earlier_attempts",
    "other",
]
"""What the GPU was doing during a stretch of the wait (see `Part`)."""

CAUSES: tuple[Cause, ...] = get_args(Cause)


class Decision(msgspec.Struct, frozen=True):
    """One dispatch decision made while the request waited (the last one may be its own)."""

    seq: int
    at: float
    queue_depth: int
    resident: str | None
    score: Breakdown
    """The request's own score at this decision."""
    winner_id: str | None
    """None only when `winner_another_caller` hides it."""
    winner_model: str
    winner: Breakdown
    reason: Reason | None
    """Why the winner beat this request; None when this request won."""
    matches_record: bool
    """The core, fed the replayed state, made exactly the recorded ScoresComputed."""
    winner_caller: str | None = None
    winner_another_caller: bool = False
    """Shown to a user key when the winner was another caller's request: its id and
    caller are then None (app/report/visibility.py)."""


class Ahead(msgspec.Struct, frozen=True):
    """A request dispatched while this one waited."""

    request_id: str | None
    """None only when `another_caller` hides it."""
    model: str
    priority: int
    band: str
    arrived_at: float
    dispatched_at: float
    reason: Reason
    reasons: list[Reason]
    """Every term that favoured it, `reason` first."""
    held_s: float
    """Time it held the GPU (not counting its swap) while this request waited."""
    caller: str | None = None
    another_caller: bool = False
    """Shown to a user key when it was another caller's request: its id and
    caller are then None (app/report/visibility.py)."""


class RunningAtArrival(msgspec.Struct, frozen=True):
    request_id: str | None
    """None only when `another_caller` hides it."""
    model: str
    priority: int
    band: str
    since: float | None
    held_s: float
    """How long this request waited behind it (not counting its swap)."""
    caller: str | None = None
    another_caller: bool = False
    """As `Ahead.another_caller`."""
    render: bool = False
    """A job that holds its model until its end is learnt (a ComfyUI render,
    `server_started.held`): this request waited for the render's end."""


class SwapWaited(msgspec.Struct, frozen=True):
    from_model: str | None
    to_model: str
    request_id: str | None
    """The request that caused it (None for a preload, or when `another_caller`)."""
    started_at: float
    duration_s: float | None
    """None while it is still in progress."""
    error: str | None
    waited_s: float
    """The part of it that fell inside this request's wait."""
    caller: str | None = None
    """The caller of the request that caused it."""
    another_caller: bool = False
    """As `Ahead.another_caller`: caused by another caller's request."""
    evicted: list[str] | None = None
    """The models it stopped to make room (`swap_started.evicted`)."""
    gpu_memory_mib: int | None = None
    """The loaded model's footprint, as measured when it became ready."""
    memory_wait_s: float | None = None
    """How long the load waited for stopped models' GPU memory (None: it did not)."""
    woke_s: float | None = None
    """The load woke `to_model`'s sleeping server in this long (no cold start)."""
    slept: list[str] = []
    """Why each model it evicted was put to sleep instead of stopped, a sentence
    in what its cold start costs (`app.core.swap_costs.slept_instead`)."""
    out_of_memory: str | None = None
    """The load failed because its server ran out of GPU memory: the line it
    printed so (`swap_failed.out_of_memory`)."""


class HeldFor(msgspec.Struct, frozen=True):
    """What a `slot`, `drain` or `evicted` part of the wait was, in the machine's
    terms (app/report/waits.py): a free slot of `model`; `model` draining for
    `request_id`; its model `model` evicted by `request_id`'s load. The seconds of
    one cause's entries add up to its `Part`."""

    cause: Cause
    model: str
    request_id: str | None
    """drain: the request the model drained for; evicted: the one whose load
    evicted it (None: unknown, a preload, or hidden by `another_caller`)."""
    seconds: float
    caller: str | None = None
    another_caller: bool = False
    """As `Ahead.another_caller`."""


class Part(msgspec.Struct, frozen=True):
    """One cause's share of the wait; the parts add up to `Explanation.wait_s`."""

    cause: Cause
    seconds: float
    percent: float


class Outcome(msgspec.Struct, frozen=True):
    status: str
    """completed, failed, cancelled, abandoned or rejected."""
    at: float
    http_status: int | None = None
    error: str | None = None
    cancel_reason: str | None = None


class Position(msgspec.Struct, frozen=True):
    """Where a still-waiting request stands as of `Explanation.as_of`."""

    position: int
    queue_depth: int
    estimated_start_at: float
    estimated_start_in_s: float
    estimated_start_open: bool = False
    """The start is only the earliest it can be: it waits behind a run longer
    than any run of its model (app/core/start_estimate.py)."""


class ChainPlace(msgspec.Struct, frozen=True):
    """The chain a request is a shot of (`X-Gpulane-Chain`, its caller's id) and
    where: `shot` 40 of `length` 174."""

    id: str
    shot: int
    """Its place in the order the chain's requests first arrived (1: the first)."""
    length: int | None = None
    """The chain's length as its caller last gave it; None: never given."""

    def text(self) -> str:
        of = f" of {self.length}" if self.length is not None else ""
        return f"shot {self.shot}{of} of chain {self.id}"


class Explanation(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    model: str | None
    model_requested: str | None
    endpoint: str
    caller: str | None
    priority: int
    """Granted: what it queued at."""
    band: str
    attempt: int
    status: str
    """queued, running, completed, failed, cancelled, abandoned or rejected."""
    as_of: float
    """The story is told up to here (the log's end, or now for the live API)."""
    arrived_at: float
    scheduler: str
    aging_divisor_s: float
    swap_affinity_bonus: int
    resident_at_arrival: str | None = None
    queue_depth_at_arrival: int = 0
    """Requests already waiting when it arrived."""
    running_at_arrival: list[RunningAtArrival] = []
    decisions: list[Decision] = []
    ahead: list[Ahead] = []
    swaps: list[SwapWaited] = []
    """Swaps that happened while it waited."""
    dispatched_at: float | None = None
    wait_s: float = 0.0
    """Measured wait: arrival to dispatch (or to its end, or to `as_of`)."""
    wait: list[Part] = []
    own_swap: SwapWaited | None = None
    started_at: float | None = None
    time_to_start_s: float | None = None
    """Arrival to its start (`request_started`): its wait and its own load
    (app/core/wait.py); None while it has not started."""
    run_s: float | None = None
    outcome: Outcome | None = None
    waiting: Position | None = None
    total_s: float = 0.0
    """Arrival to the end (or to `as_of`)."""
    replay_matches: bool = True
    """Every decision recomputed from the replayed log matched the recorded one."""
    held_for: list[HeldFor] = []
    """With `slot`, `drain` or `evicted` parts (a router or slots): which model,
    and for whom."""
    failed_loads: int = 0
    """With a `load_backoff` part: its model's failed loads in a row behind the
    last back-off it waited out."""
    requested_priority: int | None = None
    """What the caller asked for (header, else service_tier); None when it asked for
    nothing, so its key's defaultPriority (0 without one) applied. Above `priority`
    when the key's maxPriority lowered it."""
    priority_ignored: str | None = None
    """Why its priority header was ignored (it could not be read), if it was."""
    priority_unreadable: str | None = None
    """Its priority header as sent, if it could not be read (None in logs before
    this field, which have `priority_ignored` alone)."""
    chain: ChainPlace | None = None
    """The chain it is a shot of, if its caller named one."""
