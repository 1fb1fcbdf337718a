"""Every event gpulane records. Frozen, past tense, one tagged union.

Schemas only grow: a new field must have a default and no field changes type,
so a log written by any earlier version still decodes (see
tests/unit/test_events.py and its fixture log). Times are unix nanoseconds
(`at`); the store also writes them as REAL seconds for SQL.
Documented field by field in docs/events.md.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from app.core.peers import PeerPool
from app.core.residency import Router
from app.core.scoring import Breakdown

__all__ = ["Breakdown"]

StopReason = Literal[
    "evicted",
    "ttl",
    "unload",
    "crashed",
    "shutdown",
    "failed_start",
    "recovered",
    "hung",
    "reload",
    "host_memory",
    "wake_failed",
]
CancelReason = Literal["client_gone", "explicit", "shutdown", "deadline"]


class Event(msgspec.Struct, frozen=True, tag_field="type", kw_only=True):
    at: int
    """Unix time in nanoseconds when the event happened."""


LOG_FORMAT = 4
"""What `ServerStarted.log_format` says this version writes. 1 (the field absent):
recovery put open durable jobs back without recording it, so folding a format-1
`server_started` keeps them (see `app.core.state`); 2: every job put back is a
`RequestRestored` after it, and the fold starts from an empty queue; 3: as 2, and
the short-job term is per (model, endpoint), from the `expected_run_ns` of its
latest enqueue, not per request from its own (see `app.core.queue`); 4: as 3, and
`serial` runs up to each model's `concurrency` at once (`SchedulerState.slots`)."""


class ServerStarted(Event, tag="server_started", frozen=True):
    """A gpulane process started; it carries every input a decision depends on."""

    version: str
    config_hash: str
    scheduler: str
    aging_divisor_ns: int
    swap_affinity_bonus: int
    pid: int = 0
    model_priority: dict[str, int] = {}
    """fifo: each model's queue priority (`routing.scheduler.settings.fifo.priority`)."""
    concurrency: dict[str, int] = {}
    """Each model's `concurrencyLimit`, its slots; a model absent here has the
    scheduler's default (fifo 10, serial 1). Serial uses it from log format 4."""
    log_format: int = 1
    """See LOG_FORMAT."""
    fair_share_bonus: int = 0
    """serial: `fairShareBonus`, the fair-share term's most points (0 = off)."""
    short_job_bonus: int = 0
    """serial: `shortJobBonus`, the short-job term's most points (0 = off)."""
    caller_weights: dict[str, int] = {}
    """Each caller's fair-share `weight` (its API key's); a caller absent here has 1."""
    router: Router | None = None
    """Which models may be resident together (`routing.router`: `GroupRouter` or
    `MatrixRouter`, tagged `group` / `matrix`); None: one implicit group, one model
    at a time (every log before routers were used)."""
    load_backoff_ns: int = 0
    """`loadBackoff`: how long a model whose load failed waits before its next
    load, doubling with each consecutive failure (0, every log before it: no wait;
    see `app.core.load_backoff`)."""
    load_backoff_max_ns: int = 0
    """`loadBackoffMax`: the longest of those waits."""
    load_failure_limit: int = 0
    """`loadFailureLimit`: consecutive failed loads of a model after which its
    waiting requests fail with the loader's error (0: never)."""
    peers: dict[str, PeerPool] | None = None
    """`peers`: each peer's slots (shared by its models) and its model entries
    (`<peer>/<model>`, no process); None: no peers (every log before them)."""
    peer_choices: dict[str, list[str]] | None = None
    """Each bare model id several peers serve: the entries a request for it may be
    dispatched to (`app.core.peers`); its `request_dispatched.model` names the one."""
    held: list[str] = []
    """Models whose jobs run in the background (renders, `kind`): each job holds
    its model from dispatch until its end is learnt (its terminal event), and
    runs alone on it whatever `concurrency` says (`SchedulerState.slots`)."""
    max_run_time_ns: dict[str, int] = {}
    """Each model's `maxRunTime` (ns); a model absent has none (every log before
    it: unknown). Read by `db check` only: no decision depends on it."""


class ConfigReloaded(Event, tag="config_reloaded", frozen=True):
    """The server read its config again (SIGHUP, `-watch-config`) and runs under
    it from here: every later decision uses `parameters`. Unlike a
    `server_started` this is the same process: what is queued, running, loaded
    and attained stays (see `app.core.state`)."""

    config_hash: str
    parameters: ServerStarted
    """Every input a decision depends on, as a `server_started` carries them
    (its `version`, `pid` and `log_format` are this process's)."""
    source: str = ""
    """The file (or directory) read."""
    added: list[str] = []
    removed: list[str] = []
    """Models gone from the config: their waiting requests failed just before
    this (`request_failed`), their running ones finish, then they stop."""
    restarted: list[str] = []
    """Models with a process whose cmd, proxy or environment changed: each is
    stopped once idle (reason `reload`), so its next load runs the new one."""


class RequestEnqueued(Event, tag="request_enqueued", frozen=True):
    request_id: str
    model: str
    """Resolved model id."""
    model_requested: str
    """The name the caller used (may be an alias)."""
    endpoint: str
    priority: int
    """Granted: what the request queues at, after its caller's policy."""
    band: str
    durable: bool = False
    caller: str | None = None
    """A label for the caller (API key label), never the key itself."""
    idempotency_key: str | None = None
    attempt: int = 1
    enqueued_at: int | None = None
    """Original enqueue time when a durable job is re-queued; aging counts from it."""
    job: dict[str, Any] | None = None
    """Durable job payload (method, path, headers, body) needed to run it after a restart."""
    requested_priority: int | None = None
    """What the caller asked for (priority header, else service_tier); None when it
    asked for nothing (its key's defaultPriority applied) or the log predates it."""
    priority_ignored: str | None = None
    """Why its `X-LlamaSwap-Priority` was ignored (not a priority: it ran as if it
    asked for nothing); None when the header was read or absent."""
    priority_unreadable: str | None = None
    """Its `X-LlamaSwap-Priority` as sent, when it could not be read (the first 64
    characters, anything but printable ASCII escaped); None when the header was
    read or absent, and in logs before it (`priority_ignored` alone)."""
    expected_run_ns: int | None = None
    """Expected run time learnt from the log's completed runs of this model and
    endpoint, fixed here so replay scores with the same number; None: no history."""
    max_wait_ns: int | None = None
    """The longest the caller will wait in the queue (`X-Gpulane-Max-Wait`); when it
    passes the request is cancelled with reason `deadline`."""
    chain: str | None = None
    """The chain the caller named (`X-Gpulane-Chain`), the caller's own id: with
    `caller` it names one chain. None: none named (and every log before chains)."""
    chain_length: int | None = None
    """How many requests the caller said the chain has (`X-Gpulane-Chain-Length`)."""


class ScoresComputed(Event, tag="scores_computed", frozen=True):
    request_id: str
    """The winner."""
    queue_depth: int
    resident: str | None
    winner: Breakdown
    runner_up_id: str | None = None
    runner_up: Breakdown | None = None
    without_aging_id: str | None = None
    without_affinity_id: str | None = None
    without_fair_share_id: str | None = None
    without_short_job_id: str | None = None
    aging_divisor_ns: int = 0
    swap_affinity_bonus: int = 0
    fair_share_bonus: int = 0
    short_job_bonus: int = 0
    scheduler: str = "serial"
    config_hash: str = ""


class RequestDispatched(Event, tag="request_dispatched", frozen=True):
    request_id: str
    model: str
    attempt: int = 1
    swap: bool = False
    """True when the model must be loaded before the request can run."""
    choice: str | None = None
    """The bare id the request named when several peers serve it (`model` is the
    peer's entry the scheduler chose for it); None otherwise."""


class SwapStarted(Event, tag="swap_started", frozen=True):
    from_model: str | None
    to_model: str
    request_id: str | None = None
    """The request that caused the swap; None for preload."""
    evicted: list[str] | None = None
    """The models stopped to make room for `to_model` (sorted; `to_evict` of the
    router), each followed by its `process_stopping` (reason `evicted`). None (logs
    before routers): every other model in use was."""


class ProcessStarted(Event, tag="process_started", frozen=True):
    model: str
    pid: int
    cmdline: list[str]
    port: int | None = None


class SwapFinished(Event, tag="swap_finished", frozen=True):
    model: str
    duration_ms: float
    gpu_memory_mib: int | None = None
    """Its footprint in MiB: the most GPU memory it held while resident, as
    measured (NVML) up to this moment; None: not measured (no telemetry, and
    every log before footprints)."""


class SwapFailed(Event, tag="swap_failed", frozen=True):
    model: str
    error: str
    duration_ms: float = 0.0
    out_of_memory: str | None = None
    """The line of the server's output saying the GPU ran out of memory
    (app/runtime/out_of_memory.py); None: it said nothing so (and every log before)."""


class ProcessStopping(Event, tag="process_stopping", frozen=True):
    """gpulane began to stop a model's server: from here on it is not resident,
    so no decision counts on it (its process_stopped follows)."""

    model: str
    pid: int | None
    reason: StopReason
    evicted_for: str | None = None
    """With reason `evicted`: the model whose load evicted it."""
    evicted_by: str | None = None
    """With reason `evicted`: the request that load is for (None: a preload)."""
    gpu_memory_mib: int | None = None
    """Its footprint in MiB: the most GPU memory it held while resident, as
    measured (NVML) up to this moment; None: not measured (no telemetry, and
    every log before footprints)."""


class ProcessStopped(Event, tag="process_stopped", frozen=True):
    model: str
    pid: int
    reason: StopReason
    exit_code: int | None = None
    evicted_for: str | None = None
    """With reason `evicted`: the model whose load evicted it."""
    evicted_by: str | None = None
    """With reason `evicted`: the request that load is for (None: a preload)."""
    gpu_memory_mib: int | None = None
    """Its footprint in MiB: the most GPU memory it held while resident, as
    measured (NVML) up to this moment; None: not measured (no telemetry, and
    every log before footprints)."""
    duration_ms: float | None = None
    """How long the stop took, from its `process_stopping` (None: a crash, a
    failed start, and every log before it)."""
    out_of_memory: str | None = None
    """With reason `crashed` or `failed_start`: the line of its output saying the
    GPU ran out of memory, as `swap_failed`'s; None: none did (and every log before)."""


class ProcessSleeping(Event, tag="process_sleeping", frozen=True):
    """gpulane began to put a model's server to sleep (its `sleep` config) instead
    of stopping it: from here on it is not resident, as after a
    `process_stopping`; its `process_slept` (or a `sleep_skipped` and a stop)
    follows."""

    model: str
    pid: int | None
    evicted_for: str | None = None
    """The model whose load evicted it."""
    evicted_by: str | None = None
    """The request that load is for (None: a preload)."""


class ProcessSlept(Event, tag="process_slept", frozen=True):
    """The server answered its sleep calls (and its check says asleep): its process
    runs, its GPU memory is free, it holds `host_memory` bytes of host memory."""

    model: str
    pid: int
    duration_ms: float
    host_memory: int = 0
    """What it counts against `sleepHostMemory` (its `hostMemory`, 0: undeclared)."""


class ProcessWoken(Event, tag="process_woken", frozen=True):
    """A sleeping server answered its wake calls: the load of `model` (its
    `swap_started`) ends with its `swap_finished` next, with no cold start."""

    model: str
    pid: int
    duration_ms: float


class SleepSkipped(Event, tag="sleep_skipped", frozen=True):
    """A sleep or a wake that did not happen: it failed, ran past its bound, or
    (a sleep) the host memory for sleepers had no room. The process is stopped
    instead (`process_stopping` follows), and after a wake, cold-started."""

    model: str
    pid: int | None
    action: Literal["sleep", "wake"]
    why: str
    duration_ms: float = 0.0
    """How long the attempt took before gpulane gave up on it."""


class MemoryHolder(msgspec.Struct, frozen=True, kw_only=True):
    """A process of a stopped model that still holds GPU memory."""

    pid: int
    model: str
    mib: int


class MemoryWaitStarted(Event, tag="memory_wait_started", frozen=True):
    """A load waits for GPU memory that stopped models' processes still hold
    (GPU telemetry lists them), at most `limit_ms` (`memoryReleaseWait`)."""

    model: str
    """The model whose load waits."""
    holders: list[MemoryHolder] = []
    limit_ms: float = 0.0


class GpuMemorySeen(Event, tag="gpu_memory_seen", frozen=True):
    """GPU telemetry saw memory held by processes gpulane does not own change
    (another program, another container): under the memory router it is taken
    off the budget from here on. Recorded only when it moved by 1 GiB or more."""

    others_mib: int
    """Memory held by processes other than gpulane's model servers (and what
    stopped ones still hold)."""
    used_mib: int = 0
    total_mib: int = 0


class MemoryWaitEnded(Event, tag="memory_wait_ended", frozen=True):
    """The wait of `memory_wait_started` ended: the memory was released (the load
    goes on), or not within the limit (the load fails, its `swap_failed` follows
    naming the holders)."""

    model: str
    released: bool
    waited_ms: float = 0.0
    holders: list[MemoryHolder] = []
    """Not released: the processes still holding memory."""


class RequestStarted(Event, tag="request_started", frozen=True):
    """The request was sent to a ready upstream (after any swap)."""

    request_id: str
    dropped_headers: list[str] = []
    """Names of request headers not forwarded because HTTP/1.1 cannot carry their value."""


class RequestProgressed(Event, tag="request_progressed", frozen=True):
    """A running job reported how far it is (a render: steps done of steps),
    sampled: the running job's expected end follows it (`start_estimate.end_of`)."""

    request_id: str
    done: int
    total: int


class RequestCompleted(Event, tag="request_completed", frozen=True):
    request_id: str
    http_status: int
    bytes: int = 0
    ttfb_ms: float | None = None
    run_ms: float | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    tokens_per_second: float | None = None


class RequestFailed(Event, tag="request_failed", frozen=True):
    request_id: str
    error: str
    http_status: int | None = None


class RequestCancelled(Event, tag="request_cancelled", frozen=True):
    request_id: str
    reason: CancelReason


class RequestRejected(Event, tag="request_rejected", frozen=True):
    """Refused at admission (bad JSON, unknown model, too large, log unwritable):
    never queued, recorded so every request the server saw has a row."""

    request_id: str
    endpoint: str
    http_status: int
    error: str
    model_requested: str | None = None
    priority: int = 0
    band: str = "normal"
    caller: str | None = None
    reason: str | None = None
    """Why, as `/metrics` counts it: `queue_full`, `caller_queue_full`, or None for
    an invalid request (the error says what was wrong)."""


class RequestAbandoned(Event, tag="request_abandoned", frozen=True):
    """A synchronous request whose client vanished with a previous process."""

    request_id: str


class RequestRequeued(Event, tag="request_requeued", frozen=True):
    """A durable job that was running when gpulane died goes back in the queue."""

    request_id: str
    attempt: int


class RequestRestored(Event, tag="request_restored", frozen=True):
    """Recovery put an open durable job back in the queue of a new process (after a
    format-2 `server_started`). It carries all the queue needs, so a reader folding
    from here on need not have seen the enqueue. A job that was running is
    restored, then at once re-queued (`request_requeued`, attempt + 1) in the same
    batch, so it keeps its arrival place on ties."""

    request_id: str
    model: str
    priority: int
    """The header's priority, as enqueued."""
    enqueued_at: int
    """Original enqueue time (unix ns): aging continues from it."""
    attempt: int = 1
    """The attempt in the log when the previous process died."""
    durable: bool = True
    caller: str | None = None
    expected_run_ns: int | None = None
    """As enqueued: its estimate keeps its value across a restart."""
    max_wait_ns: int | None = None
    """As enqueued: the deadline still counts from `enqueued_at`."""
    endpoint: str = ""
    """As enqueued (format 3 on: the short-job term is per model and endpoint)."""


class RecoveryFinished(Event, tag="recovery_finished", frozen=True):
    requeued: int = 0
    resumed: int = 0
    abandoned: int = 0
    failed: int = 0
    processes_stopped: int = 0
    processes_left: int = 0


LeaseEnd = Literal["released", "expired", "gone"]


class LeaseAcquired(Event, tag="lease_acquired", frozen=True):
    """This process took the server lease on the log (app/store/lease.py): from here
    until the next `lease_acquired` it alone writes. Recorded just before its
    `server_started`. Changes no scheduler state and no read model."""

    term: int = 0
    """The lease's term: 1 for the first server of a database, one more at every
    take-over. A holder whose term has passed writes nothing more."""
    pid: int = 0
    host: str = ""
    listen: str = ""
    """The HOST:PORT this server listens on (`--listen`)."""
    previous_pid: int | None = None
    """The previous holder (None when the database had none)."""
    previous_host: str | None = None
    previous_listen: str | None = None
    previous_ended: LeaseEnd | None = None
    """How the previous term ended: `released` (a clean stop), `expired` (not
    renewed in time) or `gone` (its process no longer exists on this host)."""


AnyEvent = (
    ServerStarted
    | ConfigReloaded
    | RequestEnqueued
    | ScoresComputed
    | RequestDispatched
    | SwapStarted
    | ProcessStarted
    | SwapFinished
    | SwapFailed
    | ProcessStopping
    | ProcessStopped
    | ProcessSleeping
    | ProcessSlept
    | ProcessWoken
    | SleepSkipped
    | RequestStarted
    | RequestProgressed
    | RequestCompleted
    | RequestFailed
    | RequestCancelled
    | RequestRejected
    | RequestAbandoned
    | RequestRequeued
    | RequestRestored
    | RecoveryFinished
    | LeaseAcquired
    | MemoryWaitStarted
    | MemoryWaitEnded
    | GpuMemorySeen
)

TERMINAL = (RequestCompleted, RequestFailed, RequestCancelled, RequestAbandoned)

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AnyEvent)


def encode(event: AnyEvent) -> bytes:
    return _encoder.encode(event)


def decode(data: bytes | str) -> AnyEvent:
    event: AnyEvent = _decoder.decode(data)
    return event


def type_name(event: AnyEvent) -> str:
    """The tag stored in the `events.type` column."""
    tag = type(event).__struct_config__.tag
    assert isinstance(tag, str)
    return tag


def request_id_of(event: AnyEvent) -> str | None:
    return getattr(event, "request_id", None)


def model_of(event: AnyEvent) -> str | None:
    for name in ("model", "to_model"):
        value = getattr(event, name, None)
        if isinstance(value, str):
            return value
    return None
