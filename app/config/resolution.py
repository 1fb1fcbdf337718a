"""Resolving a decoded `RawConfig` into `Config`: the order of the steps and
the top-level settings.

Each part has its module: `models` (a model entry, the name index),
`routers`, `peers`, `api_keys`, `scheduling` (the scheduler and its score
terms), and `values` (checks of one value). Every problem goes to the shared
`Issues` so the caller can report them all at once; the steps run in a fixed
order, so the same config always lists its problems in the same order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from app.config.api_keys import resolve_api_keys
from app.config.checks import Issues, join_path
from app.config.macros import RESERVED, Expander, expand
from app.config.models import ModelScope, name_index, resolve_model
from app.config.peers import PeerResolver
from app.config.raw import (
    DEFAULT_DATABASE_PATH,
    DEFAULT_IGNORE_PATHS,
    DEFAULT_LEASE_SECONDS,
    DEFAULT_LOAD_BACKOFF,
    DEFAULT_LOAD_BACKOFF_MAX,
    DEFAULT_MAX_RUN_TIME,
    DEFAULT_MEMORY_RELEASE_WAIT,
    DEFAULT_RESULT_RETENTION_S,
    DEFAULT_SHUTDOWN_GRACE,
    DEFAULT_STREAM_IDLE_TIMEOUT,
    DEFAULT_UNLOAD_TIMEOUT,
    MAX_LEASE_SECONDS,
    MIN_LEASE_SECONDS,
    RawConfig,
)
from app.config.resolved import Config, ModelConfig
from app.config.routers import resolve_router
from app.config.scheduling import aging_divisor, check_bands, check_fifo_keys, fifo_priorities
from app.config.sites import resolve_allowed_hosts, resolve_allowed_origins
from app.config.sleep import resolve_host_memory
from app.config.values import (
    DURATION_FORMS,
    RunLimits,
    at_least_one,
    choice,
    limit,
    non_negative,
    positive,
    seconds,
    show_number,
    unknown_model,
)
from app.core.residency import plan_preload
from app.core.state import SCHEDULERS

NEVER_MATCHES: Final = r"(?!)"

LOG_LEVELS: Final = ("debug", "info", "warn", "error")
SYNCHRONOUS: Final = ("full", "normal")


class Resolver:
    def __init__(
        self, raw: RawConfig, data: dict[str, Any], issues: Issues, environ: Mapping[str, str]
    ) -> None:
        self.raw = raw
        self.issues = issues
        self.environ = environ
        declared = data.get("models")
        # Models dropped for errors still count as declared, so a preload
        # naming one is not also reported as unknown.
        self.declared: set[str] = (
            {k for k in declared if isinstance(k, str)} if isinstance(declared, dict) else set()
        )
        self.global_origins = {name: join_path("macros", name) for name in raw.macros}

    def run(self) -> Config:
        raw, issues = self.raw, self.issues
        self._check_global_macros()
        global_ttl = non_negative(issues, raw.global_ttl, "globalTTL", "seconds >= 0 (0 = never)")
        unload = non_negative(issues, raw.unload_timeout, "unloadTimeout", "seconds >= 0")
        unload = unload or DEFAULT_UNLOAD_TIMEOUT  # llama-swap: 0 means the default
        start_port = raw.start_port
        if not 1 <= start_port <= 65535:
            issues.error("startPort", f"{start_port} is out of range; expected 1..65535")
        scheduler = choice(issues, raw.routing.scheduler.use, "routing.scheduler.use", SCHEDULERS)
        fifo = fifo_priorities(raw, issues)
        # Every model's default; the model's own key overrides it.
        run_limits = RunLimits(
            max_run_time=limit(issues, raw.max_run_time, "maxRunTime", DEFAULT_MAX_RUN_TIME),
            stream_idle_timeout=limit(
                issues, raw.stream_idle_timeout, "streamIdleTimeout", DEFAULT_STREAM_IDLE_TIMEOUT
            ),
        )
        scope = ModelScope(
            issues=issues,
            environ=self.environ,
            macros=raw.macros,
            origins=self.global_origins,
            global_ttl=global_ttl,
            unload_timeout=unload,
            run_limits=run_limits,
            send_loading_state=raw.send_loading_state,
            has_api_keys=bool(raw.api_keys),
            scheduler=raw.routing.scheduler.use,
        )

        models: dict[str, ModelConfig] = {}
        next_port = start_port
        for model_id in sorted(raw.models):
            model = resolve_model(scope, model_id, raw.models[model_id], next_port)
            models[model_id] = msgspec.structs.replace(model, fifo_priority=fifo.get(model_id, 0))
            if model.port is not None:
                next_port += 1
        if next_port - 1 > 65535 and 1 <= start_port <= 65535:
            issues.error(
                "startPort",
                f"{start_port} leaves too few ports: {next_port - start_port} models use ${{PORT}} "
                "and ports end at 65535",
            )
        index = name_index(issues, self.declared, models)
        check_fifo_keys(issues, fifo, self.declared, index)
        router = resolve_router(
            raw,
            index,
            issues,
            lambda name, outcome: unknown_model(name, index, outcome),
            declared_mib={m: s.gpu_memory_mib for m, s in models.items() if s.gpu_memory_mib},
        )
        # Peers after the local names (local ids and aliases first) and the router.
        peers, router = PeerResolver(
            raw, issues, self.environ, self.global_origins, run_limits
        ).run(models, index, router)
        models = dict(sorted(models.items()))
        choices = {m for m, spec in models.items() if spec.choices}
        if not models and not self.declared:
            # llama-swap loads such a config too; every request then gets a 404.
            issues.warn("models", "no models and no peers: there is nothing to serve")

        serial = raw.routing.scheduler.settings.serial
        divisor, divisor_ns = aging_divisor(issues, serial.aging_divisor)
        check_bands(issues, serial)
        config = Config(
            models=models,
            health_check_timeout=positive(
                issues, raw.health_check_timeout, "healthCheckTimeout", "seconds > 0"
            ),
            start_port=start_port,
            # Any case, as llama-swap reads it.
            log_level=choice(issues, raw.log_level.strip().lower(), "logLevel", LOG_LEVELS),
            log_requests=raw.log_requests,
            api_keys=resolve_api_keys(raw, issues, self.environ, self.global_origins),
            preload=_preload(raw, issues, index, choices),
            router=router,
            peers=peers,
            send_loading_state=raw.send_loading_state,
            include_aliases_in_list=raw.include_aliases_in_list,
            scheduler=scheduler,
            aging_divisor=divisor,
            aging_divisor_ns=divisor_ns,
            swap_affinity_bonus=serial.swap_affinity_bonus,
            fair_share_bonus=serial.fair_share_bonus,
            short_job_bonus=serial.short_job_bonus,
            tier_span=serial.tier_span,
            database_path=_database_path(raw, issues),
            database_synchronous=choice(
                issues, raw.database.synchronous, "database.synchronous", SYNCHRONOUS
            ),
            database_lease_s=_lease_seconds(raw, issues),
            result_retention_s=_retention(issues, raw.jobs.result_retention),
            max_attempts=_max_attempts(raw, issues),
            min_free_disk=_min_free_disk(raw, issues),
            max_file_bytes=_max_file_bytes(raw, issues),
            max_stored_bytes_per_caller=_max_stored_bytes_per_caller(raw, issues),
            max_video_bytes=_max_video_bytes(raw, issues),
            video_dir=raw.jobs.video_dir or None,
            max_body_bytes=_max_body_bytes(raw, issues),
            allowed_hosts=resolve_allowed_hosts(raw, issues),
            allowed_origins=resolve_allowed_origins(raw, issues),
            ignore_paths=_ignore_paths(raw, issues),
            shutdown_grace=_shutdown_grace(raw, issues),
            memory_release_wait=_memory_release_wait(raw, issues),
            **_load_backoff(raw, issues),
            max_queued=at_least_one(issues, raw.max_queued, "maxQueued"),
            max_queued_per_caller=at_least_one(
                issues, raw.max_queued_per_caller, "maxQueuedPerCaller"
            ),
            sleep_host_memory=resolve_host_memory(issues, raw.sleep_host_memory, "sleepHostMemory"),
            name_index=index,
        )
        _check_preload(issues, config)
        return config

    def _check_global_macros(self) -> None:
        # Report broken global macros even when no model uses them.
        expander = Expander(
            self.raw.macros,
            environ=self.environ,
            origins=self.global_origins,
            keep=frozenset(RESERVED),
        )
        for name in self.raw.macros:
            expand(self.issues, expander, f"${{{name}}}", self.global_origins[name])


def _check_preload(issues: Issues, config: Config) -> None:
    """A preload the router cannot keep resident together is warned of here
    (`check-config`) as serve warns of it at start-up."""
    for skipped in plan_preload(config.router, config.preload).skipped:
        issues.warn("hooks.on_startup.preload", skipped.why(config.router))


def _preload(
    raw: RawConfig, issues: Issues, index: Mapping[str, str], choices: set[str]
) -> tuple[str, ...]:
    # As llama-swap: names are trimmed, blank ones dropped, and an unknown
    # one is skipped so a stale entry never stops gpulane from starting.
    out: list[str] = []
    for i, given in enumerate(raw.hooks.on_startup.preload):
        name = given.strip()
        if not name:
            continue
        model_id = index.get(name)
        if model_id is None:
            issues.warn(
                f"hooks.on_startup.preload[{i}]", unknown_model(name, index, ", not preloaded")
            )
        elif model_id in choices:
            issues.warn(
                f"hooks.on_startup.preload[{i}]",
                f"{name!r} is served by several peers; name one (peer/model) to preload it",
            )
        elif model_id not in out:
            out.append(model_id)
    return tuple(out)


def _retention(issues: Issues, value: float | str) -> float:
    allowed = f"seconds > 0, or {DURATION_FORMS}"
    total = seconds(issues, value, "jobs.resultRetention", allowed, positive=True)
    return DEFAULT_RESULT_RETENTION_S if total is None else total


def _shutdown_grace(raw: RawConfig, issues: Issues) -> float:
    allowed = f"seconds >= 0 (0 = stop upstreams at once), or {DURATION_FORMS}"
    total = seconds(issues, raw.shutdown_grace, "shutdownGrace", allowed)
    return DEFAULT_SHUTDOWN_GRACE if total is None else total


def _memory_release_wait(raw: RawConfig, issues: Issues) -> float:
    allowed = f"seconds >= 0 (0 = do not wait), or {DURATION_FORMS}"
    total = seconds(issues, raw.memory_release_wait, "memoryReleaseWait", allowed)
    return DEFAULT_MEMORY_RELEASE_WAIT if total is None else total


def _lease_seconds(raw: RawConfig, issues: Issues) -> float:
    # Under a second the renewals (a write each, every third of it) would crowd
    # the log's writer; past an hour a dead leader's standby would wait that long.
    allowed = f"seconds from {MIN_LEASE_SECONDS:g} to {MAX_LEASE_SECONDS:g}, or {DURATION_FORMS}"
    total = seconds(issues, raw.database.lease_seconds, "database.leaseSeconds", allowed)
    if total is not None and not MIN_LEASE_SECONDS <= total <= MAX_LEASE_SECONDS:
        issues.error(
            "database.leaseSeconds",
            f"{show_number(raw.database.lease_seconds)} is out of range; expected {allowed}",
        )
        total = None
    return DEFAULT_LEASE_SECONDS if total is None else total


def _load_backoff(raw: RawConfig, issues: Issues) -> dict[str, Any]:
    """`loadBackoff`, `loadBackoffMax` and `loadFailureLimit` (app/core/load_backoff.py)."""
    allowed = f"seconds >= 0 (0 = load again at once), or {DURATION_FORMS}"
    first = seconds(issues, raw.load_backoff, "loadBackoff", allowed)
    first = DEFAULT_LOAD_BACKOFF if first is None else first
    allowed = f"seconds >= 0, or {DURATION_FORMS}"
    most = seconds(issues, raw.load_backoff_max, "loadBackoffMax", allowed)
    most = DEFAULT_LOAD_BACKOFF_MAX if most is None else most
    if most < first:
        issues.error(
            "loadBackoffMax",
            f"{show_number(most)} is less than loadBackoff ({show_number(first)}); expected "
            "seconds >= loadBackoff",
        )
    failures = raw.load_failure_limit
    if failures < 0:
        issues.error(
            "loadFailureLimit",
            f"{failures} is out of range; expected an integer >= 0 (0 = never fail the "
            "waiting requests)",
        )
    return {"load_backoff": first, "load_backoff_max": most, "load_failure_limit": failures}


def _max_stored_bytes_per_caller(raw: RawConfig, issues: Issues) -> int:
    value = raw.jobs.max_stored_bytes_per_caller
    if value < 1:
        issues.error(
            "jobs.maxStoredBytesPerCaller",
            f"{value} is out of range; expected bytes, an integer >= 1",
        )
    return value


def _max_video_bytes(raw: RawConfig, issues: Issues) -> int:
    value = raw.jobs.max_video_bytes
    if value < 0:
        issues.error(
            "jobs.maxVideoBytes", f"{value} is out of range; expected bytes, an integer >= 0"
        )
    return value


def _max_file_bytes(raw: RawConfig, issues: Issues) -> int:
    value = raw.jobs.max_file_bytes
    if value < 1:
        issues.error(
            "jobs.maxFileBytes", f"{value} is out of range; expected bytes, an integer >= 1"
        )
    return value


def _max_attempts(raw: RawConfig, issues: Issues) -> int:
    value = raw.jobs.max_attempts
    if value < 1:
        issues.error("jobs.maxAttempts", f"{value} is out of range; expected an integer >= 1")
    return value


def _min_free_disk(raw: RawConfig, issues: Issues) -> int:
    value = raw.jobs.min_free_disk
    if value < 0:
        issues.error(
            "jobs.minFreeDisk", f"{value} is out of range; expected bytes, an integer >= 0"
        )
    return value


def _max_body_bytes(raw: RawConfig, issues: Issues) -> int:
    value = raw.server.max_body_bytes
    if value <= 0:
        issues.error("server.maxBodyBytes", f"{value} is out of range; expected an integer > 0")
    return value


def _database_path(raw: RawConfig, issues: Issues) -> str:
    """The database: `database.url` (an SQLAlchemy URL, or a path) when given, else
    `database.path`; both at once is an error."""
    path, url = raw.database.path, raw.database.url
    if url is not None:
        if path != DEFAULT_DATABASE_PATH:
            issues.error(
                "database.url", "give database.url or database.path, not both (a path is a URL too)"
            )
        if not url.strip():
            issues.error("database.url", "must not be empty")
        elif "://" in url and not url.startswith(("sqlite:///", "postgresql")):
            issues.error(
                "database.url",
                f"{url.split('://')[0]!r} is not a database gpulane runs on; expected "
                "sqlite:///PATH or postgresql+psycopg://USER@HOST:PORT/NAME",
            )
        return url
    if not path.strip():
        issues.error("database.path", "must not be empty")
    return path


def _ignore_paths(raw: RawConfig, issues: Issues) -> str:
    given = raw.upstream.ignore_paths
    if isinstance(given, str):  # gpulane's single-regex form: '' turns it off
        patterns = [given] if given else []
    else:  # llama-swap's list: each entry as given; an empty list is its default
        patterns = list(given) or [DEFAULT_IGNORE_PATHS]
    for i, pattern in enumerate(patterns):
        try:
            re.compile(pattern)
        except re.error as exc:
            where = "upstream.ignorePaths" + ("" if isinstance(given, str) else f"[{i}]")
            issues.error(where, f"{pattern!r} is not a valid regex: {exc}")
    if not patterns:
        return NEVER_MATCHES
    if len(patterns) == 1:
        return patterns[0]
    return "|".join(f"(?:{p})" for p in patterns)
