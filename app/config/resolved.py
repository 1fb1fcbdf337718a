"""The resolved shape of a config: what the rest of gpulane reads, its hash
and its display form."""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import msgspec

from app.config.raw import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_LEASE_SECONDS,
    DEFAULT_LOAD_BACKOFF,
    DEFAULT_LOAD_BACKOFF_MAX,
    DEFAULT_LOAD_FAILURE_LIMIT,
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_QUEUED,
    DEFAULT_MAX_QUEUED_PER_CALLER,
    DEFAULT_MAX_RUN_TIME,
    DEFAULT_MAX_STORED_BYTES_PER_CALLER,
    DEFAULT_MAX_VIDEO_BYTES,
    DEFAULT_MEMORY_RELEASE_WAIT,
    DEFAULT_MIN_FREE_DISK,
    DEFAULT_RESPONSE_HEADER_TIMEOUT,
    DEFAULT_SHUTDOWN_GRACE,
    DEFAULT_STREAM_IDLE_TIMEOUT,
)
from app.config.sleep import SleepSpec
from app.core.peers import PeerPool
from app.core.priority import DEFAULT_TIER_SPAN
from app.core.residency import Router


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """`capabilities`: what the model takes and gives, for `/v1/models` (llama-swap's)."""

    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    tools: bool = False
    reranker: bool = False
    context: int = 0

    @property
    def empty(self) -> bool:
        return self == Capabilities()


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One upstream, with every macro expanded and every default applied."""

    id: str
    cmd: tuple[str, ...]
    cmd_stop: tuple[str, ...] | None  # may hold a literal ${PID} for the runtime
    proxy: str  # no trailing slash, e.g. "http://localhost:5800"
    aliases: tuple[str, ...]
    env: dict[str, str]
    check_endpoint: str | None  # None when "none": no readiness check
    ttl: float  # seconds idle before unloading, 0 = never; merged with globalTTL
    unload_timeout: float  # seconds between a graceful stop and a kill
    unlisted: bool
    use_model_name: str | None
    name: str | None
    description: str | None
    strip_params: tuple[str, ...]
    set_params: dict[str, Any]
    set_params_by_id: dict[str, dict[str, Any]] = {}
    """`filters.setParamsByID`: params set when the request names this id (an alias)."""
    concurrency_limit: int
    metadata: dict[str, Any]
    port: int | None  # None when cmd does not use ${PORT}
    fifo_priority: int = 0
    send_loading_state: bool = False
    # Limits on one forwarded request, in seconds; None = no limit.
    connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT
    """Connecting to the upstream (TLS included): `timeouts.connect`."""
    response_header_timeout: float | None = DEFAULT_RESPONSE_HEADER_TIMEOUT
    """From sending the request to the upstream's response headers: `timeouts.responseHeader`."""
    max_run_time: float | None = DEFAULT_MAX_RUN_TIME
    """The whole run, from dispatch to the last byte: `maxRunTime`."""
    stream_idle_timeout: float | None = DEFAULT_STREAM_IDLE_TIMEOUT
    """The longest silence between body chunks once the response started: `streamIdleTimeout`."""
    pass_credentials: tuple[str, ...] = ()
    """Credential headers (lower case, sorted) forwarded to this model: `passCredentials`
    resolved against `apiKeys`. Every other credential header is stripped."""
    capabilities: Capabilities = Capabilities()
    ignore_websockets: bool = False
    """`compat.ignoreWebsockets`: a websocket to this model bypasses the queue,
    holds no slot and cannot load it (409 when it is not loaded), as in llama-swap."""
    peer: str | None = None
    """The peer this entry sends to (`peers.<id>`): no process, nothing to load."""
    headers: dict[str, str] = {}
    """Headers set on every forwarded request (a peer's `apiKey`)."""
    choices: tuple[str, ...] = ()
    """A bare id several peers serve: the entries (`<peer>/<model>`) a request
    for it may be sent to; the scheduler picks one at dispatch."""
    gpu_memory_mib: int | None = None
    """`gpuMemory`: the GPU memory it declares (MiB), its footprint until one is
    measured; None: not declared."""
    kind: str | None = None
    """`kind`: a render server whose jobs run in the background (`comfyui`,
    `openai-videos`;
    llama-swap's `comfyui_auto` id is one): each job holds the model, one at a
    time, until a probe learns its end (docs/renders.md). None: a plain server."""
    output_dir: str | None = None
    """`outputDir` (kind comfyui): ComfyUI's output folder, from which `/view`
    serves a finished prompt's images while ComfyUI is not loaded."""
    sleep: SleepSpec | None = None
    """`sleep`: how its server sleeps instead of stopping (None: it is stopped)."""


class ApiKey(msgspec.Struct, frozen=True, kw_only=True):
    """One `apiKeys` entry: a key and the caller it identifies."""

    key: str
    label: str
    """The caller's name in the log, reports and metrics: `label`, else `key#N`."""
    role: Literal["admin", "user"]
    """A plain-string key is admin (llama-swap configs keep working)."""
    max_priority: int | None = None
    """Requests asking for more are lowered to this; None = no cap."""
    default_priority: int = 0
    """The priority of a request that asks for none (no header, no service_tier)."""
    weight: int = 1
    """Share of GPU time relative to other callers (fair share)."""
    max_queued: int | None = None
    """Its own bound on waiting requests; None: `maxQueuedPerCaller`."""

    def __repr__(self) -> str:
        # Never the key: a repr ends up in logs and tracebacks.
        return f"ApiKey(label={self.label!r}, role={self.role!r})"


class Config(msgspec.Struct, frozen=True, kw_only=True):
    models: dict[str, ModelConfig]  # sorted by id
    health_check_timeout: float
    start_port: int
    log_level: str
    log_requests: bool = False
    """`logRequests`: an access line per HTTP request at info (app/web/access_log.py);
    read per request, so a reload turns it on or off."""
    api_keys: tuple[ApiKey, ...]
    preload: tuple[str, ...]  # resolved model ids
    router: Router | None = None
    """Which models may be resident together (`routing.router`, or the top-level
    `groups` / `matrix`); None: one model at a time. Not used by the run loop yet."""
    send_loading_state: bool
    peers: dict[str, PeerPool] = {}
    """`peers`: each peer's slots and model entries (its models are in `models`)."""
    include_aliases_in_list: bool = False
    """`includeAliasesInList`: /v1/models lists each alias as an entry of its own."""
    scheduler: str  # "serial" | "fifo"
    aging_divisor: float  # seconds per point of aging; 0 disables aging
    aging_divisor_ns: int  # exact: Decimal(str(aging_divisor)) * 10**9
    swap_affinity_bonus: int
    database_path: str
    fair_share_bonus: int = 0
    short_job_bonus: int = 0
    tier_span: int = DEFAULT_TIER_SPAN
    max_queued: int = DEFAULT_MAX_QUEUED
    """Waiting requests of everyone before a new one gets 429."""
    max_queued_per_caller: int = DEFAULT_MAX_QUEUED_PER_CALLER
    sleep_host_memory: int | None = None
    """`sleepHostMemory`: bytes of host memory sleeping models may hold together;
    a sleep that would pass it stops the longest-asleep sleepers first, or, when
    even alone it does not fit, the model itself (None: no bound)."""
    """The same for one caller, unless its key sets its own `maxQueued`."""
    database_synchronous: str  # "full" | "normal"
    database_lease_s: float = DEFAULT_LEASE_SECONDS
    """`database.leaseSeconds`: how long the server lease lasts unrenewed; a
    standby takes over a leader silent this long (app/runtime/leadership.py)."""
    result_retention_s: float
    max_attempts: int
    min_free_disk: int = DEFAULT_MIN_FREE_DISK
    """Bytes left free on the database's disk: a durable body that would take
    more is refused with 507 (`jobs.minFreeDisk`; 0: only a full disk refuses)."""
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    """The largest file `POST /v1/files` stores (`jobs.maxFileBytes`); 413 above it."""
    max_stored_bytes_per_caller: int = DEFAULT_MAX_STORED_BYTES_PER_CALLER
    """Bytes one caller's open durable jobs may hold in the database: bodies,
    stored headers and idempotency keys (`jobs.maxStoredBytesPerCaller`); 429 above it."""
    max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES
    """Bytes of finished videos' content kept on disk (`jobs.maxVideoBytes`): the
    oldest go first past it (docs/renders.md, the Videos API)."""
    video_dir: str | None = None
    """`jobs.videoDir`: where that content is kept; None: beside the database."""
    max_body_bytes: int
    allowed_hosts: tuple[str, ...] = ()
    """`server.allowedHosts`: names a `Host` header may carry besides localhost,
    IP addresses and the listen name (app/web/sites.py); `*`: any."""
    allowed_origins: tuple[str, ...] = ()
    """`server.allowedOrigins`: other sites whose pages may change state here
    (app/web/sites.py), each as a browser writes `Origin`; `*`: any."""
    ignore_paths: str  # one regex, for re.search on the upstream path
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE
    """Seconds running work may take to finish after SIGTERM before upstreams are stopped."""
    load_backoff: float = DEFAULT_LOAD_BACKOFF
    """Seconds a model whose load failed waits before its next load, doubling with
    each failure in a row (`loadBackoff`; 0: load again at once)."""
    load_backoff_max: float = DEFAULT_LOAD_BACKOFF_MAX
    """The longest of those waits (`loadBackoffMax`)."""
    load_failure_limit: int = DEFAULT_LOAD_FAILURE_LIMIT
    """Failed loads in a row after which a model's waiting requests fail with the
    loader's error (`loadFailureLimit`; 0: never)."""
    memory_release_wait: float = DEFAULT_MEMORY_RELEASE_WAIT
    """Seconds a load waits for a stopped model's GPU memory to be free again, with
    GPU telemetry (`memoryReleaseWait`); still held then, the load fails."""
    warnings: tuple[str, ...] = ()
    config_hash: str = ""
    source: str = "<string>"
    name_index: dict[str, str] = {}  # id or alias -> id

    def resolve_model(self, name: str) -> str | None:
        """The model id a request's `model` names (its id or an alias), or None."""
        return self.name_index.get(name)

    def caller_queue_limit(self, caller: str | None) -> int:
        """How many requests `caller` may have waiting."""
        for key in self.api_keys:
            if key.label == caller and key.max_queued is not None:
                return key.max_queued
        return self.max_queued_per_caller

    def caller_labels(self) -> tuple[str, ...]:
        """The callers `apiKeys` can name: a bounded set, unlike `X-Gpulane-Caller`."""
        return tuple(k.label for k in self.api_keys)


_HASHED_AS_BEFORE: dict[str, object] = {
    "database_lease_s": DEFAULT_LEASE_SECONDS,
    "load_backoff": DEFAULT_LOAD_BACKOFF,
    "load_backoff_max": DEFAULT_LOAD_BACKOFF_MAX,
    "load_failure_limit": DEFAULT_LOAD_FAILURE_LIMIT,
    "memory_release_wait": DEFAULT_MEMORY_RELEASE_WAIT,
}


def config_hash(config: Config) -> str:
    """First 16 hex chars of sha256 over the resolved config's canonical JSON.

    Warnings, the source path and the derived name index are left out; API keys
    enter only as their own sha256, so the hash can be logged and stored.
    """
    data = msgspec.to_builtins(config, order="deterministic")
    for key in ("warnings", "config_hash", "source", "name_index"):
        data.pop(key, None)
    if data.get("router") is None:
        data.pop("router", None)  # a config without a router hashes as before
    if not data.get("include_aliases_in_list"):
        data.pop("include_aliases_in_list", None)  # listing only; hashes as before
    if not data.get("log_requests"):
        data.pop("log_requests", None)  # logging only; hashes as before
    for key in ("allowed_hosts", "allowed_origins"):
        if not data.get(key):
            data.pop(key, None)  # unset: hashes as before
    for key, default in _HASHED_AS_BEFORE.items():
        if data.get(key) == default:
            data.pop(key, None)  # a config that leaves them unset hashes as before
    if not data.get("peers"):
        data.pop("peers", None)  # a config without peers hashes as before
    for model in data["models"].values():
        if not model.get("set_params_by_id"):
            model.pop("set_params_by_id", None)
        for key in ("peer", "headers", "choices", "gpu_memory_mib"):
            if not model.get(key):
                model.pop(key, None)
        if model.get("headers"):
            model["headers"] = {k: _digest(v) for k, v in model["headers"].items()}
    for entry in data["api_keys"]:
        entry["key"] = hashlib.sha256(entry["key"].encode()).hexdigest()
    encoded = msgspec.json.encode(data, order="sorted")
    return hashlib.sha256(encoded).hexdigest()[:16]


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def masked(config: Config) -> dict[str, Any]:
    """The resolved config as plain data for display, API keys masked."""
    data: dict[str, Any] = msgspec.to_builtins(config, order="deterministic")
    data.pop("name_index", None)
    for model in data["models"].values():
        if model.get("headers"):
            model["headers"] = {k: "***" for k in model["headers"]}
    for entry in data["api_keys"]:
        entry["key"] = "***"
    return data
