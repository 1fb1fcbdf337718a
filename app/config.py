"""Strict, llama-swap compatible configuration.

A YAML file is decoded into raw msgspec Structs shaped like the file (camelCase
keys), then resolved into `Config`/`ModelConfig`: macros expanded, ports
assigned, defaults merged. Every problem is collected before failing, so a user
fixes a config in one pass; llama-swap keys that mean nothing to a
one-model-at-a-time scheduler load with a warning instead of an error, so an
existing llama-swap config keeps working.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import os
import re
import types
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any, Final, Union, get_args, get_origin
from urllib.parse import urlsplit

import msgspec
import yaml

from app.macros import (
    NAME,
    RESERVED,
    Expander,
    MacroError,
    MacroValue,
    split_args,
    strip_comments,
)

DEFAULT_HEALTH_CHECK_TIMEOUT: Final = 120.0
DEFAULT_START_PORT: Final = 5800
DEFAULT_UNLOAD_TIMEOUT: Final = 10.0
DEFAULT_CONCURRENCY_LIMIT: Final = 10
DEFAULT_AGING_DIVISOR: Final = 60.0
DEFAULT_SWAP_AFFINITY_BONUS: Final = 10
DEFAULT_DATABASE_PATH: Final = "gpulane.db"
DEFAULT_RESULT_RETENTION_S: Final = 7 * 24 * 3600.0
DEFAULT_MAX_ATTEMPTS: Final = 3
DEFAULT_MAX_BODY_BYTES: Final = 64 * 1024 * 1024
# Static assets a web UI behind /upstream/<model>/ asks for; they must not
# trigger a swap. Anchored, so re.search and re.match agree.
DEFAULT_IGNORE_PATHS: Final = (
    r"^/(favicon\.ico|.*\.(js|mjs|css|map|json|txt|png|jpe?g|gif|svg|ico|webp|woff2?|ttf))$"
)
NEVER_MATCHES: Final = r"(?!)"
DEFAULT_PROXY: Final = "http://localhost:${PORT}"

LOG_LEVELS: Final = ("debug", "info", "warn", "error")
SCHEDULERS: Final = ("serial", "fifo")
SYNCHRONOUS: Final = ("full", "normal")
MAX_AGING_DECIMALS: Final = 9
_PORT_REF: Final = "${PORT}"
_ENV_KEY: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DURATION: Final = re.compile(r"^(?:\d+(?:\.\d+)?[dhms])+$")
_DURATION_PART: Final = re.compile(r"(\d+(?:\.\d+)?)([dhms])")
_DURATION_UNITS: Final = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


class ConfigError(Exception):
    """Every problem found in a config, one message per entry."""

    def __init__(self, errors: list[str], source: str = "<string>") -> None:
        self.errors = errors
        self.source = source
        super().__init__("\n".join(errors))


# --- Raw shape: what the YAML file looks like --------------------------------


class _Raw(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel", kw_only=True):
    pass


class RawAlias(_Raw, frozen=True):
    # Newer llama-swap also accepts `{id, name, unlisted}` objects for aliases.
    id: str
    name: str | None = None
    unlisted: bool | None = None


class RawFilters(_Raw, frozen=True):
    strip_params: str | list[str] = ""
    set_params: dict[str, Any] = {}


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


class RawOnStartup(_Raw, frozen=True):
    preload: list[str] = []


class RawHooks(_Raw, frozen=True):
    on_startup: RawOnStartup = msgspec.field(default_factory=RawOnStartup, name="on_startup")


class RawSerial(_Raw, frozen=True):
    aging_divisor: float = DEFAULT_AGING_DIVISOR
    swap_affinity_bonus: int = DEFAULT_SWAP_AFFINITY_BONUS


class RawFifo(_Raw, frozen=True):
    priority: dict[str, int] = {}


class RawSchedulerSettings(_Raw, frozen=True):
    serial: RawSerial = msgspec.field(default_factory=RawSerial)
    fifo: RawFifo = msgspec.field(default_factory=RawFifo)


class RawScheduler(_Raw, frozen=True):
    use: str = "serial"
    settings: RawSchedulerSettings = msgspec.field(default_factory=RawSchedulerSettings)


class RawRouting(_Raw, frozen=True):
    scheduler: RawScheduler = msgspec.field(default_factory=RawScheduler)


class RawDatabase(_Raw, frozen=True):
    path: str = DEFAULT_DATABASE_PATH
    synchronous: str = "full"


class RawJobs(_Raw, frozen=True):
    result_retention: float | str = DEFAULT_RESULT_RETENTION_S
    max_attempts: int = DEFAULT_MAX_ATTEMPTS


class RawServer(_Raw, frozen=True):
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


class RawUpstream(_Raw, frozen=True):
    # llama-swap takes a list of patterns; a single string is accepted too.
    ignore_paths: str | list[str] = DEFAULT_IGNORE_PATHS


class RawConfig(_Raw, frozen=True):
    health_check_timeout: float = DEFAULT_HEALTH_CHECK_TIMEOUT
    log_level: str = "info"
    start_port: int = DEFAULT_START_PORT
    global_ttl: float = msgspec.field(default=0.0, name="globalTTL")
    unload_timeout: float = DEFAULT_UNLOAD_TIMEOUT
    send_loading_state: bool = False
    macros: dict[str, MacroValue] = {}
    api_keys: list[str] = []
    hooks: RawHooks = msgspec.field(default_factory=RawHooks)
    routing: RawRouting = msgspec.field(default_factory=RawRouting)
    database: RawDatabase = msgspec.field(default_factory=RawDatabase)
    jobs: RawJobs = msgspec.field(default_factory=RawJobs)
    server: RawServer = msgspec.field(default_factory=RawServer)
    upstream: RawUpstream = msgspec.field(default_factory=RawUpstream)
    models: dict[str, RawModel] = {}


_ONE_AT_A_TIME = "gpulane runs one model at a time"
_NOT_IMPLEMENTED = "not implemented by gpulane"
# llama-swap keys we accept and ignore (with a warning), per raw struct.
IGNORED_KEYS: Final[dict[type, dict[str, str]]] = {
    RawConfig: {
        "groups": _ONE_AT_A_TIME,
        "matrix": _ONE_AT_A_TIME,
        "profiles": _ONE_AT_A_TIME,
        "selectors": _ONE_AT_A_TIME,
        "peers": "gpulane does not forward to peers",
        "performance": _NOT_IMPLEMENTED,
        "captureBuffer": _NOT_IMPLEMENTED,
        "logToStdout": _NOT_IMPLEMENTED,
        "logTimeFormat": _NOT_IMPLEMENTED,
        "metricsMaxInMemory": "gpulane keeps metrics in the event log",
        "includeAliasesInList": _NOT_IMPLEMENTED,
        "store": "use database.path",
        "ui": _NOT_IMPLEMENTED,
    },
    RawModel: {
        "timeouts": _NOT_IMPLEMENTED,
        "capabilities": _NOT_IMPLEMENTED,
    },
    RawFilters: {"setParamsByID": _NOT_IMPLEMENTED},
    RawRouting: {"router": _ONE_AT_A_TIME},
}
# Structs whose other keys are llama-swap features we skip (hooks other than
# on_startup) rather than typos, unless they look like a typo of a known key.
_OPEN_STRUCTS: Final[dict[type, str]] = {RawHooks: "gpulane only runs hooks.on_startup"}


# --- Resolved shape: what the rest of gpulane reads --------------------------


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
    concurrency_limit: int
    metadata: dict[str, Any]
    port: int | None  # None when cmd does not use ${PORT}
    fifo_priority: int = 0
    send_loading_state: bool = False


class Config(msgspec.Struct, frozen=True, kw_only=True):
    models: dict[str, ModelConfig]  # sorted by id
    health_check_timeout: float
    start_port: int
    log_level: str
    api_keys: tuple[str, ...]
    preload: tuple[str, ...]  # resolved model ids
    send_loading_state: bool
    scheduler: str  # "serial" | "fifo"
    aging_divisor: float  # seconds per point of aging; 0 disables aging
    aging_divisor_ns: int  # exact: Decimal(str(aging_divisor)) * 10**9
    swap_affinity_bonus: int
    database_path: str
    database_synchronous: str  # "full" | "normal"
    result_retention_s: float
    max_attempts: int
    max_body_bytes: int
    ignore_paths: str  # one regex, for re.search on the upstream path
    warnings: tuple[str, ...] = ()
    config_hash: str = ""
    source: str = "<string>"
    name_index: dict[str, str] = {}  # id or alias -> id

    def resolve_model(self, name: str) -> str | None:
        """The model id a request's `model` names (its id or an alias), or None."""
        return self.name_index.get(name)


def load_config(path: str | os.PathLike[str], environ: Mapping[str, str] | None = None) -> Config:
    source = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{source}: cannot read config: {exc}"], source) from exc
    return parse_config(text, source=source, environ=environ)


def parse_config(
    text: str, *, source: str = "<string>", environ: Mapping[str, str] | None = None
) -> Config:
    issues = _Issues()
    data = _load_yaml(text, source, issues)
    raw = _decode(data, issues) if data is not None else None
    if raw is None:
        raise ConfigError(issues.final_errors(), source)
    config = _Resolver(raw, data or {}, issues, os.environ if environ is None else environ).run()
    if issues.errors:
        raise ConfigError(issues.final_errors(), source)
    config = msgspec.structs.replace(config, warnings=tuple(issues.warnings), source=source)
    return msgspec.structs.replace(config, config_hash=config_hash(config))


def config_hash(config: Config) -> str:
    """First 16 hex chars of sha256 over the resolved config's canonical JSON.

    Warnings, the source path and the derived name index are left out; API keys
    enter only as their own sha256, so the hash can be logged and stored.
    """
    data = msgspec.to_builtins(config)
    for key in ("warnings", "config_hash", "source", "name_index"):
        data.pop(key, None)
    data["api_keys"] = [hashlib.sha256(key.encode()).hexdigest() for key in config.api_keys]
    encoded = msgspec.json.encode(data, order="sorted")
    return hashlib.sha256(encoded).hexdigest()[:16]


def masked(config: Config) -> dict[str, Any]:
    """The resolved config as plain data for display, API keys masked."""
    data: dict[str, Any] = msgspec.to_builtins(config)
    data.pop("name_index", None)
    data["api_keys"] = ["***" for _ in config.api_keys]
    return data


# --- Reading and decoding -----------------------------------------------------


class _Issues:
    def __init__(self) -> None:
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def error(self, path: str, message: str) -> None:
        self.errors.append(f"{path}: {message}" if path else message)

    def warn(self, path: str, message: str) -> None:
        self.warnings.append(f"{path}: {message}")

    def final_errors(self) -> list[str]:
        # A broken macro shared by many models is found once per model.
        return list(dict.fromkeys(self.errors))


class _StrictLoader(yaml.SafeLoader):
    """safe_load, plus duplicate keys as errors: PyYAML keeps the last one
    silently, which would drop a whole model defined twice."""

    duplicates: list[str]

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(
                key_node, yaml.ScalarNode
            ):
                continue
            if key_node.value in seen:
                line = key_node.start_mark.line + 1
                self.duplicates.append(f"line {line}: duplicate key {key_node.value!r}")
            seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str, source: str, issues: _Issues) -> dict[str, Any] | None:
    loader = _StrictLoader(text)
    loader.duplicates = []
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = " ".join(p for p in (exc.context, exc.problem) if p)
        issues.error(source, f"invalid YAML: {where}{problem}")
        return None
    except yaml.YAMLError as exc:
        issues.error(source, f"invalid YAML: {exc}")
        return None
    finally:
        loader.dispose()
    for message in loader.duplicates:
        issues.error(source, message)
    if data is None:
        issues.error(source, "config is empty; at least `models` is required")
        return None
    if not isinstance(data, dict):
        issues.error(source, f"expected a mapping at the top level, got {_kind(data)}")
        return None
    return data


_INVALID: Final = object()
_TYPE_WORDS: Final = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "array": "a list",
    "object": "a mapping",
    "null": "null",
}
_MSGSPEC_TYPE_ERROR: Final = re.compile(r"^Expected `([^`]*)`, got `([^`]*)`(?: - at `\$(.*)`)?$")


def _decode(data: dict[str, Any], issues: _Issues) -> RawConfig | None:
    walker = _Walker(issues)
    cleaned = walker.struct(data, RawConfig, "")
    if not isinstance(data.get("models"), dict) or not data["models"]:
        if "models" in data:
            issues.error("models", "expected a mapping of at least one model id to its settings")
        else:
            issues.error("models", "required: at least one model")
    if cleaned is _INVALID:
        return None
    try:
        # The walker reported every problem and dropped bad values; this
        # decode is the authoritative one and should not fail.
        return msgspec.convert(cleaned, RawConfig)
    except msgspec.ValidationError as exc:
        issues.error("", f"config does not decode: {exc}")
        return None


class _Walker:
    """Checks raw YAML data against the raw Structs, collecting every error
    (msgspec stops at the first) and returning the data minus what failed."""

    def __init__(self, issues: _Issues) -> None:
        self.issues = issues

    def value(self, value: Any, typ: Any, path: str) -> Any:
        if _is_struct(typ):
            return self.struct(value, typ, path)
        origin = get_origin(typ)
        if origin is dict:
            if not isinstance(value, dict):
                self.issues.error(path, f"expected a mapping, got {_show(value)}")
                return _INVALID
            _, item_type = get_args(typ)
            out: dict[str, Any] = {}
            for key, item in value.items():
                if not isinstance(key, str):
                    self.issues.error(path, f"key {key!r} must be a string; quote it")
                    continue
                checked = self.value(item, item_type, _join(path, key))
                if checked is not _INVALID:
                    out[key] = checked
            return out
        if origin is list:
            if not isinstance(value, list):
                self.issues.error(path, f"expected a list, got {_show(value)}")
                return _INVALID
            (item_type,) = get_args(typ)
            items = [self.value(item, item_type, f"{path}[{i}]") for i, item in enumerate(value)]
            return [item for item in items if item is not _INVALID]
        if origin in (Union, types.UnionType) and isinstance(value, dict):
            structs = [arg for arg in get_args(typ) if _is_struct(arg)]
            if structs:
                return self.struct(value, structs[0], path)
        return self.leaf(value, typ, path)

    def leaf(self, value: Any, typ: Any, path: str) -> Any:
        if typ is Any:
            return value
        try:
            msgspec.convert(value, typ)
        except msgspec.ValidationError as exc:
            self.issues.error(*_type_error(path, value, str(exc)))
            return _INVALID
        return value

    def struct(self, value: Any, cls: type[msgspec.Struct], path: str) -> Any:
        if not isinstance(value, dict):
            self.issues.error(path, f"expected a mapping, got {_show(value)}")
            return _INVALID
        fields = {f.encode_name: f for f in msgspec.structs.fields(cls)}
        ignored = IGNORED_KEYS.get(cls, {})
        out: dict[str, Any] = {}
        invalid_required = False
        for key, item in value.items():
            key_path = _join(path, str(key))
            if not isinstance(key, str):
                self.issues.error(path, f"key {key!r} must be a string; quote it")
                continue
            field = fields.get(key)
            if field is not None:
                if item is None and _is_container(field.type):
                    continue  # `macros:` with every entry commented out
                checked = self.value(item, field.type, key_path)
                if checked is not _INVALID:
                    out[key] = checked
                elif field.required:
                    invalid_required = True
            elif key in ignored:
                self.issues.warn(key_path, f"llama-swap key ignored: {ignored[key]}")
            else:
                close = _closest(key, [*fields, *ignored])
                if cls in _OPEN_STRUCTS and close is None:
                    self.issues.warn(key_path, f"llama-swap key ignored: {_OPEN_STRUCTS[cls]}")
                else:
                    self.issues.error(key_path, _unknown_key(close, fields))
        missing = [name for name, f in fields.items() if f.required and name not in value]
        for name in missing:
            self.issues.error(_join(path, name), "required key is missing")
        return _INVALID if missing or invalid_required else out


def _is_struct(typ: Any) -> bool:
    return isinstance(typ, type) and issubclass(typ, msgspec.Struct)


def _is_container(typ: Any) -> bool:
    return _is_struct(typ) or get_origin(typ) in (dict, list)


def _join(path: str, key: str) -> str:
    # Quote keys a reader could not split back out of a dotted path.
    part = f'["{key}"]' if (not key or "." in key or key != key.strip()) else key
    if not path:
        return part
    return f"{path}{part}" if part.startswith("[") else f"{path}.{part}"


def _closest(key: str, known: list[str]) -> str | None:
    by_lower = {k.lower().replace("_", ""): k for k in known}
    exact = by_lower.get(key.lower().replace("_", ""))
    if exact is not None:
        return exact
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return close[0] if close else None


def _unknown_key(close: str | None, fields: Mapping[str, Any]) -> str:
    if close is not None:
        return f"unknown key; did you mean {close!r}?"
    return f"unknown key; allowed keys: {', '.join(sorted(fields))}"


def _type_error(path: str, value: Any, message: str) -> tuple[str, str]:
    match = _MSGSPEC_TYPE_ERROR.match(message)
    if match is None:
        return path, message
    # `x | None` fields mean "unset" when null; saying so would only confuse.
    names = [p.strip() for p in match.group(1).split("|") if p.strip() != "null"]
    expected = " or ".join(_TYPE_WORDS.get(name, name) for name in names)
    where = match.group(3) or ""
    if where:
        return path + where.replace(
            "[...]", ""
        ), f"expected {expected}, got {_describe(match.group(2))}"
    return path, f"expected {expected}, got {_show(value)}"


def _describe(msgspec_type: str) -> str:
    return _TYPE_WORDS.get(msgspec_type, msgspec_type)


def _kind(value: Any) -> str:
    return {
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        list: "a list",
        dict: "a mapping",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({_kind(value)})"


# --- Resolving ----------------------------------------------------------------


class _Resolver:
    def __init__(
        self, raw: RawConfig, data: dict[str, Any], issues: _Issues, environ: Mapping[str, str]
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
        self.global_origins = {name: _join("macros", name) for name in raw.macros}

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

        models: dict[str, ModelConfig] = {}
        next_port = start_port
        for model_id in sorted(raw.models):
            model = self._model(model_id, raw.models[model_id], next_port, global_ttl, unload)
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

        serial = raw.routing.scheduler.settings.serial
        aging_divisor, aging_divisor_ns = self._aging_divisor(serial.aging_divisor)
        bonus = serial.swap_affinity_bonus
        if not 0 <= bonus <= 99:
            self.issues.error(
                "routing.scheduler.settings.serial.swapAffinityBonus",
                f"{bonus} is out of range; expected an integer 0..99 "
                "(bounded below 100 so affinity never crosses a priority band)",
            )
        return Config(
            models=models,
            health_check_timeout=self._positive(
                raw.health_check_timeout, "healthCheckTimeout", "seconds > 0"
            ),
            start_port=start_port,
            log_level=self._choice(raw.log_level, "logLevel", LOG_LEVELS),
            api_keys=self._api_keys(),
            preload=self._preload(name_index),
            send_loading_state=raw.send_loading_state,
            scheduler=scheduler,
            aging_divisor=aging_divisor,
            aging_divisor_ns=aging_divisor_ns,
            swap_affinity_bonus=bonus,
            database_path=self._database_path(),
            database_synchronous=self._choice(
                raw.database.synchronous, "database.synchronous", SYNCHRONOUS
            ),
            result_retention_s=self._retention(raw.jobs.result_retention),
            max_attempts=self._max_attempts(),
            max_body_bytes=self._max_body_bytes(),
            ignore_paths=self._ignore_paths(),
            name_index=name_index,
        )

    # -- models

    def _model(
        self, model_id: str, m: RawModel, next_port: int, global_ttl: float, unload: float
    ) -> ModelConfig:
        path = _join("models", model_id)
        self._check_macro_names(m.macros, f"{path}.macros")
        table: dict[str, MacroValue] = {**self.raw.macros, **m.macros}
        origins = {**self.global_origins, **{n: _join(f"{path}.macros", n) for n in m.macros}}
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

        return ModelConfig(
            id=model_id,
            cmd=cmd or (),
            cmd_stop=cmd_stop or None,
            proxy=self._proxy(m, plain, port, path),
            aliases=self._aliases(m, path),
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
            concurrency_limit=self._concurrency(m.concurrency_limit, f"{path}.concurrencyLimit"),
            metadata=self._metadata(m.metadata, plain, with_port, f"{path}.metadata"),
            port=port,
            send_loading_state=(
                self.raw.send_loading_state
                if m.send_loading_state is None
                else m.send_loading_state
            ),
        )

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

    def _aliases(self, m: RawModel, path: str) -> tuple[str, ...]:
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
        given = m.filters.strip_params
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

    def _concurrency(self, value: int, where: str) -> int:
        if value < 0:
            self.issues.error(where, f"{value} is out of range; expected an integer >= 0")
        return value if value > 0 else DEFAULT_CONCURRENCY_LIMIT

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
                k: self._metadata(v, expander, with_port, _join(where, str(k)))
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
                where = f"{_join('models', model_id)}.aliases[{i}]"
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
            where = _join(path, name)
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

    def _api_keys(self) -> tuple[str, ...]:
        expander = Expander(self.raw.macros, environ=self.environ, origins=self.global_origins)
        keys: list[str] = []
        for i, key in enumerate(self.raw.api_keys):
            where = f"apiKeys[{i}]"
            expanded = self._expand(expander, key, where)
            if expanded is None:
                continue
            if not expanded.strip():
                self.issues.error(where, "an API key must not be empty")
            else:
                keys.append(expanded)  # no dedupe: callers are labelled key#N by position
        return tuple(keys)

    def _preload(self, index: Mapping[str, str]) -> tuple[str, ...]:
        out: list[str] = []
        for i, name in enumerate(self.raw.hooks.on_startup.preload):
            model_id = index.get(name)
            if model_id is None:
                self.issues.error(
                    f"hooks.on_startup.preload[{i}]", self._unknown_model(name, index)
                )
            elif model_id not in out:
                out.append(model_id)
        return tuple(out)

    def _fifo_priorities(self) -> dict[str, int]:
        priorities = dict(self.raw.routing.scheduler.settings.fifo.priority)
        if priorities and self.raw.routing.scheduler.use != "fifo":
            self.issues.warn(
                "routing.scheduler.settings.fifo.priority",
                "only the fifo scheduler uses per-model priority; ignored by serial",
            )
        return priorities

    def _check_fifo_keys(self, fifo: Mapping[str, int], index: Mapping[str, str]) -> None:
        for name in fifo:
            where = _join("routing.scheduler.settings.fifo.priority", name)
            if name in self.declared:
                continue
            owner = index.get(name)
            if owner is not None:
                self.issues.error(where, f"{name!r} is an alias; use the model id {owner!r}")
            else:
                self.issues.error(where, self._unknown_model(name, index))

    def _unknown_model(self, name: str, index: Mapping[str, str]) -> str:
        close = difflib.get_close_matches(name, list(index), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown model {name!r}{hint}"

    def _aging_divisor(self, value: float) -> tuple[float, int]:
        where = "routing.scheduler.settings.serial.agingDivisor"
        allowed = (
            f"a number >= 0 (0 disables aging) with at most {MAX_AGING_DECIMALS} decimal places"
        )
        if not math.isfinite(value) or value < 0:
            self.issues.error(where, f"{value!r} is out of range; expected {allowed}")
            return DEFAULT_AGING_DIVISOR, int(DEFAULT_AGING_DIVISOR) * 10**9
        # repr is the shortest text that round-trips, i.e. what the user wrote.
        exact = Decimal(repr(value))
        exponent = exact.as_tuple().exponent
        if isinstance(exponent, int) and exponent < -MAX_AGING_DECIMALS:
            self.issues.error(
                where,
                f"{value!r} has too many decimal places; expected {allowed} "
                "so it converts exactly to integer nanoseconds",
            )
            return DEFAULT_AGING_DIVISOR, int(DEFAULT_AGING_DIVISOR) * 10**9
        return value, int(exact * 10**9)

    def _retention(self, value: float | str) -> float:
        where = "jobs.resultRetention"
        allowed = 'seconds > 0, or a duration like "7d", "12h", "30m", "45s" or "1d12h"'
        if isinstance(value, str):
            text = value.strip()
            if not _DURATION.match(text):
                self.issues.error(where, f"{value!r} is not a duration; expected {allowed}")
                return DEFAULT_RESULT_RETENTION_S
            seconds = sum(
                float(n) * _DURATION_UNITS[unit] for n, unit in _DURATION_PART.findall(text)
            )
        else:
            seconds = float(value)
        if not math.isfinite(seconds) or seconds <= 0:
            self.issues.error(where, f"{value!r} is out of range; expected {allowed}")
            return DEFAULT_RESULT_RETENTION_S
        return seconds

    def _max_attempts(self) -> int:
        value = self.raw.jobs.max_attempts
        if value < 1:
            self.issues.error(
                "jobs.maxAttempts", f"{value} is out of range; expected an integer >= 1"
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
