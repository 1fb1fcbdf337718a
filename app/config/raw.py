"""The raw shape of a config: msgspec Structs laid out like the YAML file.

Keys are camelCase, as in llama-swap. Nothing here is resolved: macros are
unexpanded and optional values are still unset; `app.config.resolution` turns
a `RawConfig` into the `Config` the rest of gpulane reads.
"""

from __future__ import annotations

import re
from typing import Any, Final

import msgspec

from app.config.macros import MacroValue
from app.core.priority import DEFAULT_TIER_SPAN
from app.core.scoring import DEFAULT_AGING_DIVISOR_NS, DEFAULT_SWAP_AFFINITY_BONUS, NS_PER_S
from app.core.state import SERIAL

DEFAULT_HEALTH_CHECK_TIMEOUT: Final = 120.0
DEFAULT_START_PORT: Final = 5800
DEFAULT_UNLOAD_TIMEOUT: Final = 10.0
# The scoring defaults belong to the core; the file states them in seconds.
DEFAULT_AGING_DIVISOR: Final = DEFAULT_AGING_DIVISOR_NS / NS_PER_S
DEFAULT_DATABASE_PATH: Final = "gpulane.db"
# How long the server lease lasts unrenewed: a standby takes over a leader that
# hangs or loses its host this long after its last renewal (a killed leader on
# the standby's own host at once). Renewed every third of it.
DEFAULT_LEASE_SECONDS: Final = 15.0
MIN_LEASE_SECONDS: Final = 1.0
MAX_LEASE_SECONDS: Final = 3600.0
DEFAULT_RESULT_RETENTION_S: Final = 7 * 24 * 3600.0
DEFAULT_MAX_ATTEMPTS: Final = 3
# Disk space a durable job's body may not take (507 instead): the log needs room.
DEFAULT_MIN_FREE_DISK: Final = 256 * 1024 * 1024
# The largest file `POST /v1/files` stores (413 above it): held whole in memory once.
DEFAULT_MAX_FILE_BYTES: Final = 200 * 1024 * 1024
# Bytes one caller's open durable jobs may hold in the database (bodies,
# stored headers, idempotency keys): 429 above it. 64 bodies of the largest size.
DEFAULT_MAX_STORED_BYTES_PER_CALLER: Final = 4 * 1024 * 1024 * 1024
# The most bytes of finished videos' content gpulane keeps (`jobs.maxVideoBytes`).
DEFAULT_MAX_VIDEO_BYTES: Final = 20 * 1024 * 1024 * 1024
DEFAULT_MAX_BODY_BYTES: Final = 64 * 1024 * 1024
# Limits on one forwarded request, in seconds. Generous on purpose: a
# 16-minute non-streaming render must finish, and so must a streamed one that
# sends its headers first and then nothing until the end.
DEFAULT_CONNECT_TIMEOUT: Final = 10.0
DEFAULT_RESPONSE_HEADER_TIMEOUT: Final = 3600.0
DEFAULT_MAX_RUN_TIME: Final = 7200.0
DEFAULT_STREAM_IDLE_TIMEOUT: Final = 1200.0
DEFAULT_SHUTDOWN_GRACE: Final = 30.0
# A model that fails to load waits 5 s before its next load, doubling up to
# 5 minutes; after 3 failures in a row its waiting requests fail.
DEFAULT_LOAD_BACKOFF: Final = 5.0
DEFAULT_LOAD_BACKOFF_MAX: Final = 300.0
DEFAULT_LOAD_FAILURE_LIMIT: Final = 3
# With GPU telemetry, a load waits this long for a stopped model's memory to be
# free again (Ollama waits up to 5 s); still held then, the load fails.
DEFAULT_MEMORY_RELEASE_WAIT: Final = 10.0
# Static assets a web UI behind /upstream/<model>/ asks for; they must not
# trigger a swap. Anchored, so re.search and re.match agree.
DEFAULT_IGNORE_PATHS: Final = (
    r"^/(favicon\.ico|.*\.(js|mjs|css|map|json|txt|png|jpe?g|gif|svg|ico|webp|woff2?|ttf))$"
)


class _Raw(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel", kw_only=True):
    pass


class RawAlias(_Raw, frozen=True):
    # Newer llama-swap also accepts `{id, name, unlisted}` objects for aliases.
    id: str
    name: str | None = None
    unlisted: bool | None = None


class RawFilters(_Raw, frozen=True):
    strip_params: str | list[str] = ""
    # llama-swap's older spelling of stripParams, read when stripParams is unset.
    strip_params_legacy: str | list[str] = msgspec.field(default="", name="strip_params")
    set_params: dict[str, Any] = {}
    # requested id -> params set for it; each key is also an alias of the model.
    set_params_by_id: dict[str, dict[str, Any]] = msgspec.field(
        default_factory=dict, name="setParamsByID"
    )


class RawTimeouts(_Raw, frozen=True):
    # llama-swap reads whole seconds (Go ints), 0 = no limit; unset = gpulane's
    # default. Numbers with a fraction are accepted too.
    connect: float | None = None
    response_header: float | None = None


class RawCapabilities(_Raw, frozen=True):
    # llama-swap's ModelCapConfig: rendered into /v1/models as llama-swap renders it.
    in_: list[str] = msgspec.field(default_factory=list, name="in")
    out: list[str] = []
    tools: bool = False
    reranker: bool = False
    context: int = 0


class RawCompat(_Raw, frozen=True):
    # llama-swap's only compat key.
    ignore_websockets: bool = False


class RawModel(_Raw, frozen=True):
    cmd: str
    cmd_stop: str = ""
    proxy: str | None = None
    aliases: list[str | RawAlias] = []
    env: list[str] = []
    check_endpoint: str = "/health"
    ttl: float | None = None
    unload_timeout: float | None = None
    unlisted: bool = False
    use_model_name: str = ""
    name: str = ""
    description: str = ""
    filters: RawFilters = msgspec.field(default_factory=RawFilters)
    concurrency_limit: int = 0
    metadata: dict[str, Any] = {}
    macros: dict[str, MacroValue] = {}
    send_loading_state: bool | None = None
    timeouts: RawTimeouts = msgspec.field(default_factory=RawTimeouts)
    compat: RawCompat = msgspec.field(default_factory=RawCompat)
    capabilities: RawCapabilities = msgspec.field(default_factory=RawCapabilities)
    # gpulane only: unset = the top-level value.
    max_run_time: float | str | None = None
    stream_idle_timeout: float | str | None = None
    # gpulane only: credential headers forwarded to this model; unset = forward
    # them when no apiKeys are configured, strip them when some are.
    pass_credentials: bool | list[str] | None = None
    # gpulane only: the GPU memory the model takes ("24GiB"), until it is measured.
    gpu_memory: str | int | None = None
    # gpulane only: a server whose jobs run in the background (`comfyui`,
    # `openai-videos`): each
    # holds the model until its end is learnt (docs/renders.md).
    kind: str | None = None
    # gpulane only, with kind comfyui: ComfyUI's output folder, from which a
    # finished prompt's images are served while ComfyUI is not loaded.
    output_dir: str | None = None
    # gpulane only: how the server sleeps instead of stopping (app/config/sleep.py).
    sleep: str | dict[str, Any] | None = None


class RawPeer(_Raw, frozen=True):
    """A `peers` entry: another server (a gpulane, a llama-swap, any OpenAI-compatible
    server) whose `models` are served here as `<peer>/<model>`."""

    proxy: str
    models: list[str]
    api_key: str = ""
    filters: RawFilters = msgspec.field(default_factory=RawFilters)
    timeouts: RawTimeouts = msgspec.field(default_factory=RawTimeouts)
    # gpulane only: requests sent to the peer at once, across all its models.
    concurrency_limit: int = 1


DEFAULT_MAX_QUEUED = 100_000
DEFAULT_MAX_QUEUED_PER_CALLER = 10_000


class RawApiKey(_Raw, frozen=True):
    """An `apiKeys` entry as a mapping; a plain string is `{key: ...}` with role admin."""

    key: str
    label: str | None = None
    role: str | None = None
    # Integers, or a band name with an optional offset ("interactive+2").
    max_priority: int | str | None = None
    default_priority: int | str | None = None
    weight: int = 1
    max_queued: int | None = None


class RawOnStartup(_Raw, frozen=True):
    preload: list[str] = []


class RawHooks(_Raw, frozen=True):
    on_startup: RawOnStartup = msgspec.field(default_factory=RawOnStartup, name="on_startup")


class RawSerial(_Raw, frozen=True):
    aging_divisor: float = DEFAULT_AGING_DIVISOR
    swap_affinity_bonus: int = DEFAULT_SWAP_AFFINITY_BONUS
    fair_share_bonus: int = 0
    short_job_bonus: int = 0
    tier_span: int = DEFAULT_TIER_SPAN


class RawFifo(_Raw, frozen=True):
    priority: dict[str, int] = {}


class RawSchedulerSettings(_Raw, frozen=True):
    serial: RawSerial = msgspec.field(default_factory=RawSerial)
    fifo: RawFifo = msgspec.field(default_factory=RawFifo)


class RawScheduler(_Raw, frozen=True):
    use: str = SERIAL
    settings: RawSchedulerSettings = msgspec.field(default_factory=RawSchedulerSettings)


class RawGroup(_Raw, frozen=True):
    # llama-swap's defaults: a group holds one model and stops the others.
    swap: bool = True
    exclusive: bool = True
    persistent: bool = False
    members: list[str] = []


class RawMatrix(_Raw, frozen=True):
    vars: dict[str, str] = {}
    sets: dict[str, str] = {}  # name -> expression, in definition order
    evict_costs: dict[str, int] = msgspec.field(default_factory=dict, name="evict_costs")


class RawMemoryRouter(_Raw, frozen=True):
    """gpulane only: `routing.router.settings.memory`."""

    budget: str | int = "auto"  # "auto" | a size ("80GiB")
    reserve: str | int | None = None  # with auto: what is left free (a size)
    side_by_side: bool = False


class RawRouterSettings(_Raw, frozen=True):
    groups: dict[str, RawGroup] = {}
    matrix: RawMatrix | None = None
    memory: RawMemoryRouter | None = None


class RawRouter(_Raw, frozen=True):
    use: str = ""  # "" | "group" | "matrix" | "memory"; "" is group
    settings: RawRouterSettings = msgspec.field(default_factory=RawRouterSettings)


class RawRouting(_Raw, frozen=True):
    scheduler: RawScheduler = msgspec.field(default_factory=RawScheduler)
    router: RawRouter = msgspec.field(default_factory=RawRouter)


class RawDatabase(_Raw, frozen=True):
    path: str = DEFAULT_DATABASE_PATH
    url: str | None = None
    synchronous: str = "full"
    lease_seconds: float | str = DEFAULT_LEASE_SECONDS


class RawJobs(_Raw, frozen=True):
    result_retention: float | str = DEFAULT_RESULT_RETENTION_S
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    min_free_disk: int = DEFAULT_MIN_FREE_DISK
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    max_stored_bytes_per_caller: int = DEFAULT_MAX_STORED_BYTES_PER_CALLER
    max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES
    video_dir: str | None = None


class RawServer(_Raw, frozen=True):
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Who may reach gpulane from a browser (app/config/sites.py, app/web/sites.py).
    allowed_hosts: list[str] = []
    allowed_origins: list[str] = []


class RawUpstream(_Raw, frozen=True):
    # llama-swap takes a list of patterns; a single string is accepted too.
    ignore_paths: str | list[str] = DEFAULT_IGNORE_PATHS


class RawConfig(_Raw, frozen=True):
    health_check_timeout: float = DEFAULT_HEALTH_CHECK_TIMEOUT
    log_level: str = "info"
    log_requests: bool = False
    start_port: int = DEFAULT_START_PORT
    global_ttl: float = msgspec.field(default=0.0, name="globalTTL")
    unload_timeout: float = DEFAULT_UNLOAD_TIMEOUT
    send_loading_state: bool = False
    include_aliases_in_list: bool = False
    # gpulane only: defaults for every model, and the grace period on SIGTERM.
    max_run_time: float | str = DEFAULT_MAX_RUN_TIME
    stream_idle_timeout: float | str = DEFAULT_STREAM_IDLE_TIMEOUT
    shutdown_grace: float | str = DEFAULT_SHUTDOWN_GRACE
    load_backoff: float | str = DEFAULT_LOAD_BACKOFF
    load_backoff_max: float | str = DEFAULT_LOAD_BACKOFF_MAX
    load_failure_limit: int = DEFAULT_LOAD_FAILURE_LIMIT
    memory_release_wait: float | str = DEFAULT_MEMORY_RELEASE_WAIT
    max_queued: int = DEFAULT_MAX_QUEUED
    max_queued_per_caller: int = DEFAULT_MAX_QUEUED_PER_CALLER
    # gpulane only: the host memory sleeping models may hold together (bytes or "64GiB").
    sleep_host_memory: int | str | None = None
    macros: dict[str, MacroValue] = {}
    api_keys: list[str | RawApiKey] = []
    hooks: RawHooks = msgspec.field(default_factory=RawHooks)
    routing: RawRouting = msgspec.field(default_factory=RawRouting)
    # llama-swap's older spelling of routing.router.settings.groups / .matrix.
    groups: dict[str, RawGroup] = {}
    matrix: RawMatrix | None = None
    database: RawDatabase = msgspec.field(default_factory=RawDatabase)
    jobs: RawJobs = msgspec.field(default_factory=RawJobs)
    server: RawServer = msgspec.field(default_factory=RawServer)
    upstream: RawUpstream = msgspec.field(default_factory=RawUpstream)
    models: dict[str, RawModel] = {}
    peers: dict[str, RawPeer] = {}


_ONE_AT_A_TIME = "gpulane runs one model at a time"
_NOT_IMPLEMENTED = "not implemented by gpulane"
# llama-swap keys we accept and ignore (with a warning), per raw struct.
IGNORED_KEYS: Final[dict[type, dict[str, str]]] = {
    RawConfig: {
        "profiles": _ONE_AT_A_TIME,
        "selectors": _ONE_AT_A_TIME,
        "performance": _NOT_IMPLEMENTED,
        "captureBuffer": _NOT_IMPLEMENTED,
        "logToStdout": _NOT_IMPLEMENTED,
        "logTimeFormat": _NOT_IMPLEMENTED,
        "metricsMaxInMemory": "gpulane keeps metrics in the event log",
        "store": "use database.path",
        "ui": _NOT_IMPLEMENTED,
    },
    RawModel: {
        # llama-swap overwrites it with the top-level value too.
        "healthCheckTimeout": "the top-level healthCheckTimeout applies to every model",
    },
    RawTimeouts: {
        "keepalive": "gpulane sets no TCP keep-alive; streamIdleTimeout ends a silent upstream",
        "tlsHandshake": "the TLS handshake counts toward timeouts.connect",
        "expectContinue": "gpulane sends the body without waiting for 100 Continue",
        "idleConn": "idle upstream connections are pooled for all models alike",
    },
}
# Structs whose other keys are llama-swap features we skip (hooks other than
# on_startup) rather than typos, unless they look like a typo of a known key.
OPEN_STRUCTS: Final[dict[type, str]] = {RawHooks: "gpulane only runs hooks.on_startup"}
# llama-swap's sections: an unknown key loads with a warning naming it, as
# llama-swap ignores it, unless one edit from a key gpulane reads (`tll`), which
# stays an error naming the key meant. The pattern names the keys that hold
# YAML anchors only (`defs:`, `x-common:`): they load without a warning.
# gpulane's own sections (database, jobs, server, apiKeys' mappings, the
# scheduler's settings) stay strict: any unknown key there is an error.
_NO_ANCHORS: Final = re.compile(r"(?!)")
LENIENT_STRUCTS: Final[dict[type, re.Pattern[str]]] = {
    RawConfig: re.compile(r"defs|x-.*"),
    **{
        cls: _NO_ANCHORS
        for cls in (
            RawAlias,
            RawFilters,
            RawTimeouts,
            RawCompat,
            RawCapabilities,
            RawModel,
            RawPeer,
            RawOnStartup,
            RawGroup,
            RawMatrix,
            RawRouterSettings,
            RawRouter,
            RawRouting,
            RawUpstream,
        )
    },
}
