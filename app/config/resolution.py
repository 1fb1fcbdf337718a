"""Resolving a decoded `RawConfig` into `Config`/`ModelConfig`.

Macros are expanded, ports assigned and defaults merged; every problem goes
to the shared `Issues` so the caller can report them all at once.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, Final, NamedTuple
from urllib.parse import urlsplit

import msgspec

from app.config.callers import (
    CALLER_LABEL_RULE,
    PASSABLE_CREDENTIALS,
    ROLES,
    is_caller_label,
)
from app.config.checks import Issues, join_path
from app.config.macros import (
    NAME,
    RESERVED,
    Expander,
    MacroError,
    MacroValue,
    split_args,
    strip_comments,
)
from app.config.peers import PeerResolver
from app.config.raw import (
    DEFAULT_AGING_DIVISOR,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_LOAD_BACKOFF,
    DEFAULT_LOAD_BACKOFF_MAX,
    DEFAULT_MAX_RUN_TIME,
    DEFAULT_RESPONSE_HEADER_TIMEOUT,
    DEFAULT_RESULT_RETENTION_S,
    DEFAULT_SHUTDOWN_GRACE,
    DEFAULT_STREAM_IDLE_TIMEOUT,
    DEFAULT_UNLOAD_TIMEOUT,
    RawAlias,
    RawApiKey,
    RawConfig,
    RawModel,
    RawSerial,
)
from app.config.resolved import ApiKey, Config, ModelConfig
from app.config.routers import resolve_router
from app.core.priority import (
    ALIASES,
    BAND_STEP,
    MAX_PRIORITY,
    MIN_PRIORITY,
    band_lift_error,
    tier_offset,
)
from app.core.residency import describe, plan_preload
from app.core.scoring import DEFAULT_AGING_DIVISOR_NS
from app.core.state import FIFO, SCHEDULERS, default_concurrency

NEVER_MATCHES: Final = r"(?!)"
DEFAULT_PROXY: Final = "http://localhost:${PORT}"

LOG_LEVELS: Final = ("debug", "info", "warn", "error")
SYNCHRONOUS: Final = ("full", "normal")
MAX_AGING_DECIMALS: Final = 9
_PORT_REF: Final = "${PORT}"
_ENV_KEY: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DURATION: Final = re.compile(r"^(?:\d+(?:\.\d+)?[dhms])+$")
_DURATION_PART: Final = re.compile(r"(\d+(?:\.\d+)?)([dhms])")
_DURATION_UNITS: Final = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_DURATION_FORMS: Final = 'a duration like "7d", "12h", "30m", "45s" or "1d12h"'
# "interactive+2", "batch - 1", "normal", or a quoted integer ("-98").
_BAND_OFFSET: Final = re.compile(
    r"(?:(interactive|normal|batch)(?:\s*([+-])\s*(\d{1,20}))?|([+-]?\d{1,20}))"
)
MAX_WEIGHT: Final = 1000
"""Weights are ratios between callers; a larger one is a typo."""


class _RunLimits(NamedTuple):
    max_run_time: float | None
    stream_idle_timeout: float | None


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
        self._choices: set[str] = set()

    def run(self) -> Config:
        raw = self.raw
        self._check_macro_names(raw.macros, "macros")
        self._check_global_macros()
        global_ttl = self._non_negative(raw.global_ttl, "globalTTL", "seconds >= 0 (0 = never)")
        unload = self._non_negative(raw.unload_timeout, "unloadTimeout", "seconds >= 0")
        unload = unload or DEFAULT_UNLOAD_TIMEOUT  # llama-swap: 0 means the default
        start_port = raw.start_port
        if not 1 <= start_port <= 65535:
            self.issues.error("startPort", f"{start_port} is out of range; expected 1..65535")
        scheduler = self._choice(raw.routing.scheduler.use, "routing.scheduler.use", SCHEDULERS)
        fifo = self._fifo_priorities()
        # Every model's default; the model's own key overrides it.
        run_limits = _RunLimits(
            max_run_time=self._limit(raw.max_run_time, "maxRunTime", DEFAULT_MAX_RUN_TIME),
            stream_idle_timeout=self._limit(
                raw.stream_idle_timeout, "streamIdleTimeout", DEFAULT_STREAM_IDLE_TIMEOUT
            ),
        )

        models: dict[str, ModelConfig] = {}
        next_port = start_port
        for model_id in sorted(raw.models):
            model = self._model(
                model_id, raw.models[model_id], next_port, global_ttl, unload, run_limits
            )
            models[model_id] = msgspec.structs.replace(model, fifo_priority=fifo.get(model_id, 0))
            if model.port is not None:
                next_port += 1
        if next_port - 1 > 65535 and 1 <= start_port <= 65535:
            self.issues.error(
                "startPort",
                f"{start_port} leaves too few ports: {next_port - start_port} models use ${{PORT}} "
                "and ports end at 65535",
            )
        name_index = self._name_index(models)
        self._check_fifo_keys(fifo, name_index)
        router = resolve_router(
            raw, name_index, self.issues, lambda name: self._unknown_model(name, name_index)
        )
        # Peers after the local names (local ids and aliases first) and the router.
        peers, router = PeerResolver(self, run_limits).run(models, name_index, router)
        models = dict(sorted(models.items()))
        self._choices = {m for m, spec in models.items() if spec.choices}

        serial = raw.routing.scheduler.settings.serial
        aging_divisor, aging_divisor_ns = self._aging_divisor(serial.aging_divisor)
        bonus = serial.swap_affinity_bonus
        self._check_bands(serial)
        config = Config(
            models=models,
            health_check_timeout=self._positive(
                raw.health_check_timeout, "healthCheckTimeout", "seconds > 0"
            ),
            start_port=start_port,
            log_level=self._choice(raw.log_level, "logLevel", LOG_LEVELS),
            api_keys=self._api_keys(),
            preload=self._preload(name_index),
            router=router,
            peers=peers,
            send_loading_state=raw.send_loading_state,
            include_aliases_in_list=raw.include_aliases_in_list,
            scheduler=scheduler,
            aging_divisor=aging_divisor,
            aging_divisor_ns=aging_divisor_ns,
            swap_affinity_bonus=bonus,
            fair_share_bonus=serial.fair_share_bonus,
            short_job_bonus=serial.short_job_bonus,
            tier_span=serial.tier_span,
            database_path=self._database_path(),
            database_synchronous=self._choice(
                raw.database.synchronous, "database.synchronous", SYNCHRONOUS
            ),
            result_retention_s=self._retention(raw.jobs.result_retention),
            max_attempts=self._max_attempts(),
            min_free_disk=self._min_free_disk(),
            max_file_bytes=self._max_file_bytes(),
            max_body_bytes=self._max_body_bytes(),
            ignore_paths=self._ignore_paths(),
            shutdown_grace=self._shutdown_grace(),
            **self._load_backoff(),
            max_queued=self._at_least_one(raw.max_queued, "maxQueued"),
            max_queued_per_caller=self._at_least_one(
                raw.max_queued_per_caller, "maxQueuedPerCaller"
            ),
            name_index=name_index,
        )
        self._check_preload(config)
        return config

    def _check_preload(self, config: Config) -> None:
        """A preload the router cannot keep resident together is warned of here
        (`check-config`) as serve warns of it at start-up."""
        for skipped in plan_preload(config.router, config.preload).skipped:
            self.issues.warn(
                "hooks.on_startup.preload",
                f"{skipped.model!r} is not preloaded: with {describe(config.router)} it "
                f"would evict {', '.join(map(repr, skipped.conflicts))}, listed before it",
            )

    # -- models

    def _model(
        self,
        model_id: str,
        m: RawModel,
        next_port: int,
        global_ttl: float,
        unload: float,
        run_limits: _RunLimits,
    ) -> ModelConfig:
        path = join_path("models", model_id)
        self._check_macro_names(m.macros, f"{path}.macros")
        table: dict[str, MacroValue] = {**self.raw.macros, **m.macros}
        origins = {**self.global_origins, **{n: join_path(f"{path}.macros", n) for n in m.macros}}
        builtins: dict[str, MacroValue] = {"MODEL_ID": model_id}

        def expander(keep: frozenset[str]) -> Expander:
            return Expander(
                table, environ=self.environ, origins=origins, builtins=builtins, keep=keep
            )

        plain = expander(frozenset({"PORT"}))
        stop = expander(frozenset({"PORT", "PID"}))

        cmd_text = self._expand(plain, strip_comments(m.cmd), f"{path}.cmd")
        # A cmd that failed to expand may well use ${PORT}; assuming so avoids
        # a second, misleading error about the proxy.
        port = next_port if cmd_text is None or _PORT_REF in cmd_text else None

        def with_port(text: str | None, where: str) -> str | None:
            if text is None or _PORT_REF not in text:
                return text
            if port is None:
                self.issues.error(
                    where, "uses ${PORT} but cmd does not, so this model has no port assigned"
                )
                return None
            return text.replace(_PORT_REF, str(port))

        cmd = self._argv(with_port(cmd_text, f"{path}.cmd"), f"{path}.cmd")
        if cmd == ():
            self.issues.error(f"{path}.cmd", "is empty")
        cmd_stop: tuple[str, ...] | None = None
        if m.cmd_stop.strip():
            stop_text = self._expand(stop, strip_comments(m.cmd_stop), f"{path}.cmdStop")
            cmd_stop = self._argv(with_port(stop_text, f"{path}.cmdStop"), f"{path}.cmdStop")

        by_id = self._set_params_by_id(m, plain, path)
        return ModelConfig(
            id=model_id,
            cmd=cmd or (),
            cmd_stop=cmd_stop or None,
            proxy=self._proxy(m, plain, port, path),
            aliases=self._aliases(m, path, [k for k in by_id if k != model_id]),
            env=self._env(m, plain, with_port, path),
            check_endpoint=self._check_endpoint(m, plain, with_port, path),
            ttl=self._ttl(m.ttl, global_ttl, f"{path}.ttl"),
            unload_timeout=self._model_unload(m.unload_timeout, unload, f"{path}.unloadTimeout"),
            unlisted=m.unlisted,
            use_model_name=m.use_model_name or None,
            name=m.name or None,
            description=m.description or None,
            strip_params=self._strip_params(m, plain, path),
            set_params=self._set_params(m, path),
            set_params_by_id=by_id,
            concurrency_limit=self._concurrency(m.concurrency_limit, f"{path}.concurrencyLimit"),
            metadata=self._metadata(m.metadata, plain, with_port, f"{path}.metadata"),
            port=port,
            send_loading_state=(
                self.raw.send_loading_state
                if m.send_loading_state is None
                else m.send_loading_state
            ),
            # llama-swap's timeouts take numbers only, as llama-swap does.
            connect_timeout=self._limit(
                m.timeouts.connect,
                f"{path}.timeouts.connect",
                DEFAULT_CONNECT_TIMEOUT,
                durations=False,
            ),
            response_header_timeout=self._limit(
                m.timeouts.response_header,
                f"{path}.timeouts.responseHeader",
                DEFAULT_RESPONSE_HEADER_TIMEOUT,
                durations=False,
            ),
            max_run_time=self._limit(m.max_run_time, f"{path}.maxRunTime", run_limits.max_run_time),
            stream_idle_timeout=self._limit(
                m.stream_idle_timeout, f"{path}.streamIdleTimeout", run_limits.stream_idle_timeout
            ),
            pass_credentials=self._pass_credentials(m.pass_credentials, f"{path}.passCredentials"),
        )

    def _pass_credentials(self, value: bool | list[str] | None, where: str) -> tuple[str, ...]:
        if value is None:
            # Without apiKeys gpulane checks no credential, so one a client sends is
            # meant for the upstream (llama-swap forwards it); with apiKeys it is ours.
            value = not self.raw.api_keys
        if isinstance(value, bool):
            return tuple(sorted(PASSABLE_CREDENTIALS)) if value else ()
        names: set[str] = set()
        for i, name in enumerate(value):
            lower = name.strip().lower()
            if lower not in PASSABLE_CREDENTIALS:
                self.issues.error(
                    f"{where}[{i}]",
                    f"{name!r} is not a credential header gpulane can pass; expected one of "
                    f"{', '.join(sorted(PASSABLE_CREDENTIALS))} (other headers are always "
                    "forwarded, proxy-authorization never)",
                )
                continue
            names.add(lower)
        return tuple(sorted(names))

    def _expand(self, expander: Expander, text: str, where: str) -> str | None:
        try:
            return expander.expand(text)
        except MacroError as exc:
            for location, message in exc.problems:
                self.issues.error(location or where, message)
            return None

    def _argv(self, text: str | None, where: str) -> tuple[str, ...] | None:
        if text is None:
            return None
        try:
            return tuple(split_args(text))
        except ValueError as exc:
            self.issues.error(where, f"cannot split into arguments: {exc}")
            return None

    def _proxy(self, m: RawModel, expander: Expander, port: int | None, path: str) -> str:
        where = f"{path}.proxy"
        text = self._expand(expander, m.proxy if m.proxy is not None else DEFAULT_PROXY, where)
        if text is None:
            return ""
        if _PORT_REF in text:
            if port is None:
                if m.proxy is None:
                    self.issues.error(
                        where,
                        f"not set, and the default {DEFAULT_PROXY} needs cmd to use ${{PORT}}; "
                        "set proxy to the URL the upstream listens on",
                    )
                else:
                    self.issues.error(where, "uses ${PORT} but cmd does not use ${PORT}")
                return ""
            text = text.replace(_PORT_REF, str(port))
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            self.issues.error(where, f"{text!r} is not an http:// or https:// URL with a host")
        return text.rstrip("/")

    def _aliases(self, m: RawModel, path: str, by_id: list[str]) -> tuple[str, ...]:
        out: list[str] = []
        for i, alias in enumerate(m.aliases):
            where = f"{path}.aliases[{i}]"
            if isinstance(alias, RawAlias):
                for key in ("name", "unlisted"):
                    if getattr(alias, key) is not None:
                        self.issues.warn(f"{where}.{key}", "ignored: aliases are names only")
                alias = alias.id
            if not alias.strip():
                self.issues.error(where, "an alias must not be empty")
                continue
            out.append(alias)
        # llama-swap: each setParamsByID key (but the model's own id) is an alias too.
        out += [k for k in by_id if k not in out]
        return tuple(out)

    def _env(self, m: RawModel, expander: Expander, with_port: Any, path: str) -> dict[str, str]:
        env: dict[str, str] = {}
        for i, item in enumerate(m.env):
            where = f"{path}.env[{i}]"
            key, sep, value = item.partition("=")
            if not sep or not _ENV_KEY.match(key):
                self.issues.error(where, f"{item!r} is not KEY=VALUE with KEY a variable name")
                continue
            if key in env:
                self.issues.error(where, f"{key} is set twice")
                continue
            expanded = with_port(self._expand(expander, value, where), where)
            env[key] = expanded if expanded is not None else ""
        return env

    def _check_endpoint(
        self, m: RawModel, expander: Expander, with_port: Any, path: str
    ) -> str | None:
        where = f"{path}.checkEndpoint"
        text = with_port(self._expand(expander, m.check_endpoint, where), where)
        if text is None or text == "none":
            return None
        if not text.startswith("/"):
            self.issues.error(where, f"{text!r} must be a path starting with / or `none`")
        return str(text)

    def _ttl(self, ttl: float | None, global_ttl: float, where: str) -> float:
        if ttl is None or ttl == -1:
            return global_ttl
        if ttl < 0 or not math.isfinite(ttl):
            self.issues.error(
                where, f"{ttl!r} is out of range; expected -1 (use globalTTL), 0 (never) or seconds"
            )
            return 0.0
        return float(ttl)

    def _model_unload(self, value: float | None, default: float, where: str) -> float:
        if value is None or value == 0:
            return default
        return self._non_negative(value, where, "seconds >= 0 (0 = use unloadTimeout)")

    def _strip_params(self, m: RawModel, expander: Expander, path: str) -> tuple[str, ...]:
        where = f"{path}.filters.stripParams"
        given = m.filters.strip_params or m.filters.strip_params_legacy
        items = given.split(",") if isinstance(given, str) else given
        out: list[str] = []
        for item in items:
            name = (self._expand(expander, item, where) or "").strip()
            if name == "model":
                self.issues.warn(where, "`model` is never stripped; entry ignored")
            elif name and name not in out:
                out.append(name)
        return tuple(out)

    def _set_params(self, m: RawModel, path: str) -> dict[str, Any]:
        params = dict(m.filters.set_params)
        if params.pop("model", None) is not None:
            self.issues.warn(f"{path}.filters.setParams.model", "`model` cannot be set; ignored")
        return params

    def _set_params_by_id(
        self, m: RawModel, expander: Expander, path: str
    ) -> dict[str, dict[str, Any]]:
        """Requested id -> params; macros expanded in the ids, as llama-swap does
        (`${MODEL_ID}:high`)."""
        out: dict[str, dict[str, Any]] = {}
        for key, given in m.filters.set_params_by_id.items():
            where = join_path(f"{path}.filters.setParamsByID", key)
            requested = (self._expand(expander, key, where) or "").strip()
            if not requested:
                self.issues.error(where, "an id must not be empty")
                continue
            params = dict(given)
            if params.pop("model", None) is not None:
                self.issues.warn(f"{where}.model", "`model` cannot be set; ignored")
            out[requested] = params
        return out

    def _concurrency(self, value: int, where: str) -> int:
        if value < 0:
            self.issues.error(where, f"{value} is out of range; expected an integer >= 0")
        return value if value > 0 else default_concurrency(self.raw.routing.scheduler.use)

    def _metadata(self, value: Any, expander: Expander, with_port: Any, where: str) -> Any:
        if isinstance(value, str):
            try:
                expanded = expander.expand_typed(value)
            except MacroError as exc:
                for location, message in exc.problems:
                    self.issues.error(location or where, message)
                return value
            if expanded == _PORT_REF:
                filled = with_port(expanded, where)
                return int(filled) if filled is not None else value
            return with_port(expanded, where) if isinstance(expanded, str) else expanded
        if isinstance(value, dict):
            return {
                k: self._metadata(v, expander, with_port, join_path(where, str(k)))
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [
                self._metadata(v, expander, with_port, f"{where}[{i}]") for i, v in enumerate(value)
            ]
        return value

    def _name_index(self, models: Mapping[str, ModelConfig]) -> dict[str, str]:
        index = {model_id: model_id for model_id in self.declared | set(models)}
        for model_id, model in models.items():
            for i, alias in enumerate(model.aliases):
                where = f"{join_path('models', model_id)}.aliases[{i}]"
                owner = index.get(alias)
                if alias in self.declared:
                    self.issues.error(where, f"alias {alias!r} is also a model id")
                elif owner == model_id:
                    self.issues.error(where, f"alias {alias!r} is listed twice")
                elif owner is not None:
                    self.issues.error(where, f"alias {alias!r} is already an alias of {owner!r}")
                else:
                    index[alias] = model_id
        return index

    # -- top level

    def _check_macro_names(self, macros: Mapping[str, MacroValue], path: str) -> None:
        for name in macros:
            where = join_path(path, name)
            if name in RESERVED:
                self.issues.error(where, f"{name} is a reserved macro name")
            elif not NAME.match(name):
                self.issues.error(
                    where, "macro names are 1-64 characters of letters, digits, _ and -"
                )

    def _check_global_macros(self) -> None:
        # Report broken global macros even when no model uses them.
        expander = Expander(
            self.raw.macros,
            environ=self.environ,
            origins=self.global_origins,
            keep=frozenset(RESERVED),
        )
        for name in self.raw.macros:
            self._expand(expander, f"${{{name}}}", self.global_origins[name])

    def _api_keys(self) -> tuple[ApiKey, ...]:
        expander = Expander(self.raw.macros, environ=self.environ, origins=self.global_origins)
        keys: list[ApiKey] = []
        key_at: dict[str, int] = {}
        label_at: dict[str, int] = {}
        for i, entry in enumerate(self.raw.api_keys):
            where = f"apiKeys[{i}]"
            raw = entry if isinstance(entry, RawApiKey) else None
            key_where = where if raw is None else f"{where}.key"
            text = entry.key if isinstance(entry, RawApiKey) else entry
            key = self._expand(expander, text, key_where)
            if key is not None and not key.strip():
                self.issues.error(key_where, "an API key must not be empty")
                key = None
            elif key is not None and key != key.strip():
                # Bearer, Basic and x-api-key values are trimmed before they are compared.
                self.issues.error(
                    key_where,
                    "an API key must not start or end with whitespace "
                    "(it could never be presented)",
                )
                key = None
            if key is not None:
                # Compared as given, never printed: errors end up in logs.
                if key in key_at:
                    self.issues.error(
                        key_where,
                        f"the same key as apiKeys[{key_at[key]}]; every key must be unique",
                    )
                key_at.setdefault(key, i)
            api_key = self._api_key(raw, key or "", i, where)
            first = label_at.get(api_key.label)
            if first is not None:
                self.issues.error(
                    f"{where}.label",
                    f"{api_key.label!r} is already the label of apiKeys[{first}]; "
                    "labels must be unique",
                )
            label_at.setdefault(api_key.label, i)
            if key is not None:
                keys.append(api_key)
        return tuple(keys)

    def _api_key(self, raw: RawApiKey | None, key: str, i: int, where: str) -> ApiKey:
        # A plain string (llama-swap) is an admin key labelled by its position.
        if raw is None:
            return ApiKey(key=key, label=f"key#{i + 1}", role="admin")
        label = f"key#{i + 1}" if raw.label is None else raw.label
        if not is_caller_label(label):
            self.issues.error(
                f"{where}.label", f"{label!r} is not a caller label; expected {CALLER_LABEL_RULE}"
            )
        role = self._choice(raw.role or "user", f"{where}.role", ROLES)
        cap = self._priority_setting(raw.max_priority, f"{where}.maxPriority")
        default = self._priority_setting(raw.default_priority, f"{where}.defaultPriority")
        if cap is not None and default is not None and default > cap:
            self.issues.error(
                f"{where}.defaultPriority",
                f"{default} is above maxPriority {cap}; every request without a header "
                "would be lowered",
            )
        if not 1 <= raw.weight <= MAX_WEIGHT:
            self.issues.error(
                f"{where}.weight",
                f"{raw.weight} is out of range; expected an integer 1..{MAX_WEIGHT}",
            )
        span = self.raw.routing.scheduler.settings.serial.tier_span
        for value, setting in ((cap, "maxPriority"), (default, "defaultPriority")):
            # A warning, not an error: an uncapped caller may send any number
            # anyway; the band check is sized by tierSpan.
            if value is not None and not 0 <= tier_offset(value) <= span:
                self.issues.warn(
                    f"{where}.{setting}",
                    f"{value} is {tier_offset(value):+d} from its band's base, outside "
                    f"0..tierSpan ({span}, routing.scheduler.settings.serial.tierSpan): "
                    "the bounded score terms may lift it into the next band",
                )
        if default is None:
            # What a request asking for nothing gets: 0, or the cap when below it.
            default = 0 if cap is None else min(0, cap)
        return ApiKey(
            key=key,
            label=label,
            role="admin" if role == "admin" else "user",
            max_priority=cap,
            default_priority=default,
            weight=raw.weight,
            max_queued=(
                None
                if raw.max_queued is None
                else self._at_least_one(raw.max_queued, f"{where}.maxQueued")
            ),
        )

    def _at_least_one(self, value: int, where: str) -> int:
        if value < 1:
            self.issues.error(where, f"{value} is out of range; expected an integer >= 1")
            return 1
        return value

    def _check_bands(self, serial: RawSerial) -> None:
        """Each bounded term is 0..99, and together with the tier span they can
        never lift a request into the next band (aging alone crosses bands)."""
        where = "routing.scheduler.settings.serial"
        bounded = {
            "swapAffinityBonus": serial.swap_affinity_bonus,
            "fairShareBonus": serial.fair_share_bonus,
            "shortJobBonus": serial.short_job_bonus,
        }
        valid = True
        for key, points in [*bounded.items(), ("tierSpan", serial.tier_span)]:
            if not 0 <= points <= BAND_STEP - 1:
                self.issues.error(
                    f"{where}.{key}",
                    f"{points} is out of range; expected an integer 0..{BAND_STEP - 1} "
                    "(bounded terms never cross a priority band)",
                )
                valid = False
        error = band_lift_error(bounded, serial.tier_span) if valid else None
        if error is not None:
            self.issues.error(where, error)

    def _priority_setting(self, value: int | str | None, where: str) -> int | None:
        """maxPriority/defaultPriority: an integer, a band, or a band plus an offset."""
        if value is None:
            return None
        if isinstance(value, str):
            match = _BAND_OFFSET.fullmatch(value.strip().lower())
            if match is None:
                self.issues.error(
                    where,
                    f"{value!r} is not a priority; expected an integer, interactive, normal or "
                    "batch, optionally + or - an integer (interactive+2)",
                )
                return None
            band, sign, offset, integer = match.groups()
            if integer is not None:
                number = int(integer)
            else:
                number = ALIASES[band] + (-1 if sign == "-" else 1) * int(offset or 0)
        else:
            number = value
        if not MIN_PRIORITY <= number <= MAX_PRIORITY:
            self.issues.error(where, f"{number} is out of range; expected -2^63..2^63-1")
            return None
        return number

    def _preload(self, index: Mapping[str, str]) -> tuple[str, ...]:
        # As llama-swap: names are trimmed, blank ones dropped, and an unknown
        # one is skipped so a stale entry never stops gpulane from starting.
        out: list[str] = []
        for i, given in enumerate(self.raw.hooks.on_startup.preload):
            name = given.strip()
            if not name:
                continue
            model_id = index.get(name)
            if model_id is None:
                self.issues.warn(
                    f"hooks.on_startup.preload[{i}]",
                    self._unknown_model(name, index, ", not preloaded"),
                )
            elif model_id in self._choices:
                self.issues.warn(
                    f"hooks.on_startup.preload[{i}]",
                    f"{name!r} is served by several peers; name one (peer/model) to preload it",
                )
            elif model_id not in out:
                out.append(model_id)
        return tuple(out)

    def _fifo_priorities(self) -> dict[str, int]:
        priorities = dict(self.raw.routing.scheduler.settings.fifo.priority)
        if priorities and self.raw.routing.scheduler.use != FIFO:
            self.issues.warn(
                "routing.scheduler.settings.fifo.priority",
                "only the fifo scheduler uses per-model priority; ignored by serial",
            )
        return priorities

    def _check_fifo_keys(self, fifo: Mapping[str, int], index: Mapping[str, str]) -> None:
        for name in fifo:
            where = join_path("routing.scheduler.settings.fifo.priority", name)
            if name in self.declared:
                continue
            owner = index.get(name)
            if owner is not None:
                self.issues.error(where, f"{name!r} is an alias; use the model id {owner!r}")
            else:
                self.issues.error(where, self._unknown_model(name, index))

    def _unknown_model(self, name: str, index: Mapping[str, str], outcome: str = "") -> str:
        close = difflib.get_close_matches(name, list(index), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown model {name!r}{outcome}{hint}"

    def _aging_divisor(self, value: float) -> tuple[float, int]:
        where = "routing.scheduler.settings.serial.agingDivisor"
        allowed = (
            f"a number >= 0 (0 disables aging) with at most {MAX_AGING_DECIMALS} decimal places"
        )
        if not math.isfinite(value) or value < 0:
            self.issues.error(where, f"{value!r} is out of range; expected {allowed}")
            return DEFAULT_AGING_DIVISOR, DEFAULT_AGING_DIVISOR_NS
        # repr is the shortest text that round-trips, i.e. what the user wrote.
        exact = Decimal(repr(value))
        exponent = exact.as_tuple().exponent
        if isinstance(exponent, int) and exponent < -MAX_AGING_DECIMALS:
            self.issues.error(
                where,
                f"{value!r} has too many decimal places; expected {allowed} "
                "so it converts exactly to integer nanoseconds",
            )
            return DEFAULT_AGING_DIVISOR, DEFAULT_AGING_DIVISOR_NS
        return value, int(exact * 10**9)

    def _retention(self, value: float | str) -> float:
        allowed = f"seconds > 0, or {_DURATION_FORMS}"
        seconds = self._seconds(value, "jobs.resultRetention", allowed, positive=True)
        return DEFAULT_RESULT_RETENTION_S if seconds is None else seconds

    def _limit(
        self,
        value: float | str | None,
        where: str,
        default: float | None,
        *,
        durations: bool = True,
    ) -> float | None:
        """A time limit: unset is `default`, 0 is no limit (None)."""
        if value is None:
            return default
        allowed = "seconds >= 0 (0 = no limit)"
        if durations:
            allowed += f", or {_DURATION_FORMS}"
        seconds = self._seconds(value, where, allowed)
        if seconds is None:
            return default
        return seconds or None

    def _shutdown_grace(self) -> float:
        allowed = f"seconds >= 0 (0 = stop upstreams at once), or {_DURATION_FORMS}"
        seconds = self._seconds(self.raw.shutdown_grace, "shutdownGrace", allowed)
        return DEFAULT_SHUTDOWN_GRACE if seconds is None else seconds

    def _load_backoff(self) -> dict[str, Any]:
        """`loadBackoff`, `loadBackoffMax` and `loadFailureLimit` (app/core/load_backoff.py)."""
        raw = self.raw
        allowed = f"seconds >= 0 (0 = load again at once), or {_DURATION_FORMS}"
        first = self._seconds(raw.load_backoff, "loadBackoff", allowed)
        first = DEFAULT_LOAD_BACKOFF if first is None else first
        allowed = f"seconds >= 0, or {_DURATION_FORMS}"
        most = self._seconds(raw.load_backoff_max, "loadBackoffMax", allowed)
        most = DEFAULT_LOAD_BACKOFF_MAX if most is None else most
        if most < first:
            self.issues.error(
                "loadBackoffMax",
                f"{_number(most)} is less than loadBackoff ({_number(first)}); expected "
                "seconds >= loadBackoff",
            )
        limit = raw.load_failure_limit
        if limit < 0:
            self.issues.error(
                "loadFailureLimit",
                f"{limit} is out of range; expected an integer >= 0 (0 = never fail the "
                "waiting requests)",
            )
        return {"load_backoff": first, "load_backoff_max": most, "load_failure_limit": limit}

    def _seconds(
        self, value: float | str, where: str, allowed: str, *, positive: bool = False
    ) -> float | None:
        """Seconds from a number or a duration string; None (and an error) if bad."""
        if isinstance(value, str):
            text = value.strip()
            if not _DURATION.match(text):
                self.issues.error(where, f"{value!r} is not a duration; expected {allowed}")
                return None
            seconds = sum(
                float(n) * _DURATION_UNITS[unit] for n, unit in _DURATION_PART.findall(text)
            )
        else:
            seconds = float(value)
        if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
            self.issues.error(where, f"{_number(value)} is out of range; expected {allowed}")
            return None
        return seconds

    def _max_file_bytes(self) -> int:
        value = self.raw.jobs.max_file_bytes
        if value < 1:
            self.issues.error(
                "jobs.maxFileBytes", f"{value} is out of range; expected bytes, an integer >= 1"
            )
        return value

    def _max_attempts(self) -> int:
        value = self.raw.jobs.max_attempts
        if value < 1:
            self.issues.error(
                "jobs.maxAttempts", f"{value} is out of range; expected an integer >= 1"
            )
        return value

    def _min_free_disk(self) -> int:
        value = self.raw.jobs.min_free_disk
        if value < 0:
            self.issues.error(
                "jobs.minFreeDisk", f"{value} is out of range; expected bytes, an integer >= 0"
            )
        return value

    def _max_body_bytes(self) -> int:
        value = self.raw.server.max_body_bytes
        if value <= 0:
            self.issues.error(
                "server.maxBodyBytes", f"{value} is out of range; expected an integer > 0"
            )
        return value

    def _database_path(self) -> str:
        path = self.raw.database.path
        if not path.strip():
            self.issues.error("database.path", "must not be empty")
        return path

    def _ignore_paths(self) -> str:
        given = self.raw.upstream.ignore_paths
        patterns = [given] if isinstance(given, str) else list(given)
        patterns = [p for p in patterns if p]
        for i, pattern in enumerate(patterns):
            try:
                re.compile(pattern)
            except re.error as exc:
                where = "upstream.ignorePaths" + ("" if isinstance(given, str) else f"[{i}]")
                self.issues.error(where, f"{pattern!r} is not a valid regex: {exc}")
        if not patterns:
            return NEVER_MATCHES  # an empty list or string ignores nothing
        if len(patterns) == 1:
            return patterns[0]
        return "|".join(f"(?:{p})" for p in patterns)

    def _choice(self, value: str, where: str, allowed: tuple[str, ...]) -> str:
        if value not in allowed:
            self.issues.error(
                where, f"{value!r} is not allowed; expected one of {', '.join(allowed)}"
            )
        return value

    def _positive(self, value: float, where: str, allowed: str) -> float:
        if not math.isfinite(value) or value <= 0:
            self.issues.error(where, f"{value!r} is out of range; expected {allowed}")
        return float(value)

    def _non_negative(self, value: float, where: str, allowed: str) -> float:
        if not math.isfinite(value) or value < 0:
            self.issues.error(where, f"{value!r} is out of range; expected {allowed}")
            return 0.0
        return float(value)


def _number(value: float | str) -> str:
    # YAML's -1 arrives as -1.0 through a float field; show it as written.
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)
