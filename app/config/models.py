"""Resolving one `models` entry into a `ModelConfig`, and the name index.

A model's macros are the global ones plus its own (its own win) and the
builtins `${MODEL_ID}` and `${PORT}`; `${PORT}` is the next free port when its
cmd uses it. The filters (`stripParams`, `setParams`) and `passCredentials`
are resolved here for peers too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

from app.config.callers import PASSABLE_CREDENTIALS
from app.config.checks import Issues, join_path
from app.config.macros import (
    Expander,
    MacroError,
    MacroValue,
    expand,
    split_args,
    strip_comments,
)
from app.config.memory_size import parse_mib
from app.config.raw import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_RESPONSE_HEADER_TIMEOUT,
    RawAlias,
    RawCapabilities,
    RawFilters,
    RawModel,
)
from app.config.resolved import Capabilities, ModelConfig
from app.config.sleep import resolve_sleep
from app.config.values import RunLimits, limit, non_negative
from app.core.state import default_concurrency

DEFAULT_PROXY: Final = "http://localhost:${PORT}"
PORT_REF: Final = "${PORT}"
_ENV_KEY: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

WithPort = Callable[[str | None, str], str | None]


@dataclass(frozen=True)
class ModelScope:
    """What every model is resolved against: the top-level settings."""

    issues: Issues
    environ: Mapping[str, str]
    macros: Mapping[str, MacroValue]
    """The global macros, and where each is defined."""
    origins: Mapping[str, str]
    global_ttl: float
    unload_timeout: float
    run_limits: RunLimits
    send_loading_state: bool
    has_api_keys: bool
    scheduler: str


def resolve_model(scope: ModelScope, model_id: str, m: RawModel, next_port: int) -> ModelConfig:
    issues = scope.issues
    path = join_path("models", model_id)
    table: dict[str, MacroValue] = {**scope.macros, **m.macros}
    origins = {**scope.origins, **{n: join_path(f"{path}.macros", n) for n in m.macros}}
    builtins: dict[str, MacroValue] = {"MODEL_ID": model_id}

    def expander(keep: frozenset[str]) -> Expander:
        return Expander(table, environ=scope.environ, origins=origins, builtins=builtins, keep=keep)

    plain = expander(frozenset({"PORT"}))
    stop = expander(frozenset({"PORT", "PID"}))

    cmd_text = expand(issues, plain, strip_comments(m.cmd), f"{path}.cmd")
    # A cmd that failed to expand may well use ${PORT}; assuming so avoids
    # a second, misleading error about the proxy.
    port = next_port if cmd_text is None or PORT_REF in cmd_text else None

    def with_port(text: str | None, where: str) -> str | None:
        if text is None or PORT_REF not in text:
            return text
        if port is None:
            issues.error(where, "uses ${PORT} but cmd does not, so this model has no port assigned")
            return None
        return text.replace(PORT_REF, str(port))

    cmd = _argv(issues, with_port(cmd_text, f"{path}.cmd"), f"{path}.cmd")
    if cmd == ():
        issues.error(f"{path}.cmd", "is empty")
    cmd_stop: tuple[str, ...] | None = None
    if m.cmd_stop.strip():
        stop_text = expand(issues, stop, strip_comments(m.cmd_stop), f"{path}.cmdStop")
        cmd_stop = _argv(issues, with_port(stop_text, f"{path}.cmdStop"), f"{path}.cmdStop")

    by_id = _set_params_by_id(issues, m, plain, path)
    run_limits = scope.run_limits
    return ModelConfig(
        id=model_id,
        cmd=cmd or (),
        cmd_stop=cmd_stop or None,
        proxy=_proxy(issues, m, plain, port, path),
        aliases=_ports(
            _aliases(issues, m, path, [k for k in by_id if k != model_id]),
            with_port,
            f"{path}.aliases",
        ),
        env=_env(issues, m, plain, with_port, path),
        check_endpoint=_check_endpoint(issues, m, plain, with_port, path),
        ttl=_ttl(issues, m.ttl, scope.global_ttl, f"{path}.ttl"),
        unload_timeout=_model_unload(
            issues, m.unload_timeout, scope.unload_timeout, f"{path}.unloadTimeout"
        ),
        unlisted=m.unlisted,
        use_model_name=_ports(m.use_model_name, with_port, f"{path}.useModelName") or None,
        name=_ports(m.name, with_port, f"{path}.name") or None,
        description=_ports(m.description, with_port, f"{path}.description") or None,
        strip_params=strip_params(issues, m.filters, plain, f"{path}.filters.stripParams"),
        set_params=_ports(
            set_params(issues, m.filters, path), with_port, f"{path}.filters.setParams"
        ),
        set_params_by_id=_ports(by_id, with_port, f"{path}.filters.setParamsByID"),
        concurrency_limit=_concurrency(
            issues, m.concurrency_limit, scope.scheduler, f"{path}.concurrencyLimit"
        ),
        metadata=_metadata(issues, m.metadata, plain, with_port, f"{path}.metadata"),
        port=port,
        send_loading_state=(
            scope.send_loading_state if m.send_loading_state is None else m.send_loading_state
        ),
        # llama-swap's timeouts take numbers only, as llama-swap does.
        connect_timeout=limit(
            issues,
            m.timeouts.connect,
            f"{path}.timeouts.connect",
            DEFAULT_CONNECT_TIMEOUT,
            durations=False,
        ),
        response_header_timeout=limit(
            issues,
            m.timeouts.response_header,
            f"{path}.timeouts.responseHeader",
            DEFAULT_RESPONSE_HEADER_TIMEOUT,
            durations=False,
        ),
        max_run_time=limit(issues, m.max_run_time, f"{path}.maxRunTime", run_limits.max_run_time),
        stream_idle_timeout=limit(
            issues,
            m.stream_idle_timeout,
            f"{path}.streamIdleTimeout",
            run_limits.stream_idle_timeout,
        ),
        pass_credentials=pass_credentials(
            issues, m.pass_credentials, scope.has_api_keys, f"{path}.passCredentials"
        ),
        capabilities=_capabilities(issues, m.capabilities, f"{path}.capabilities"),
        ignore_websockets=m.compat.ignore_websockets,
        gpu_memory_mib=(
            None if m.gpu_memory is None else parse_mib(issues, m.gpu_memory, f"{path}.gpuMemory")
        ),
        kind=(kind := _kind(issues, m.kind, model_id, f"{path}.kind")),
        output_dir=_output_dir(issues, m.output_dir, kind, f"{path}.outputDir"),
        sleep=resolve_sleep(issues, m.sleep, f"{path}.sleep", kind),
    )


RENDER_KINDS = ("comfyui", "openai-videos")
"""Servers whose jobs run in the background, each with its probe (docs/renders.md)."""
COMFYUI_AUTO = "comfyui_auto"
"""llama-swap's model id for `/comfyui/...`: a ComfyUI server unless said otherwise."""


def _output_dir(issues: Issues, folder: str | None, kind: str | None, where: str) -> str | None:
    if folder is None:
        return None
    if kind != "comfyui":
        issues.error(where, "is ComfyUI's output folder: set it on a model with kind: comfyui")
        return None
    if not folder.strip():
        issues.error(where, "is empty; give ComfyUI's output folder, or leave it out")
        return None
    return folder


def _kind(issues: Issues, kind: str | None, model_id: str, where: str) -> str | None:
    if kind is None:
        return "comfyui" if model_id == COMFYUI_AUTO else None
    if kind not in RENDER_KINDS:
        issues.error(where, f"is {kind!r}; allowed: {', '.join(RENDER_KINDS)} (or leave it out)")
        return None
    return kind


def pass_credentials(
    issues: Issues, value: bool | list[str] | None, has_api_keys: bool, where: str
) -> tuple[str, ...]:
    if value is None:
        # Without apiKeys gpulane checks no credential, so one a client sends is
        # meant for the upstream (llama-swap forwards it); with apiKeys it is ours.
        value = not has_api_keys
    if isinstance(value, bool):
        return tuple(sorted(PASSABLE_CREDENTIALS)) if value else ()
    names: set[str] = set()
    for i, name in enumerate(value):
        lower = name.strip().lower()
        if lower not in PASSABLE_CREDENTIALS:
            issues.error(
                f"{where}[{i}]",
                f"{name!r} is not a credential header gpulane can pass; expected one of "
                f"{', '.join(sorted(PASSABLE_CREDENTIALS))} (other headers are always "
                "forwarded, proxy-authorization never)",
            )
            continue
        names.add(lower)
    return tuple(sorted(names))


def strip_params(
    issues: Issues, filters: RawFilters, expander: Expander, where: str
) -> tuple[str, ...]:
    given: Any = filters.strip_params or filters.strip_params_legacy
    items = given.split(",") if isinstance(given, str) else given
    out: list[str] = []
    for item in items:
        name = (expand(issues, expander, item, where) or "").strip()
        if name == "model":
            issues.warn(where, "`model` is never stripped; entry ignored")
        elif name and name not in out:
            out.append(name)
    return tuple(out)


def set_params(issues: Issues, filters: RawFilters, path: str) -> dict[str, Any]:
    params = dict(filters.set_params)
    if params.pop("model", None) is not None:
        issues.warn(f"{path}.filters.setParams.model", "`model` cannot be set; ignored")
    return params


def http_url(issues: Issues, text: str, where: str) -> str:
    """A proxy URL without its trailing slash; an error unless http(s) with a host."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        issues.error(where, f"{text!r} is not an http:// or https:// URL with a host")
    return text.rstrip("/")


def name_index(
    issues: Issues, declared: set[str], models: Mapping[str, ModelConfig]
) -> dict[str, str]:
    """Model ids and aliases -> model id; an alias taken twice is an error."""
    index = {model_id: model_id for model_id in declared | set(models)}
    for model_id, model in models.items():
        for i, alias in enumerate(model.aliases):
            where = f"{join_path('models', model_id)}.aliases[{i}]"
            owner = index.get(alias)
            if alias in declared:
                issues.error(where, f"alias {alias!r} is also a model id")
            elif owner == model_id:
                issues.error(where, f"alias {alias!r} is listed twice")
            elif owner is not None:
                issues.error(where, f"alias {alias!r} is already an alias of {owner!r}")
            else:
                index[alias] = model_id
    return index


def _ports(value: Any, with_port: WithPort, where: str) -> Any:
    """`value` with `${PORT}` filled in (a lone one as the number), as llama-swap
    fills it in every value of a model whose cmd uses it."""
    if isinstance(value, str):
        filled = with_port(value, where) if PORT_REF in value else value
        if filled is None:
            return value
        return int(filled) if value == PORT_REF else filled
    if isinstance(value, dict):
        return {k: _ports(v, with_port, join_path(where, str(k))) for k, v in value.items()}
    if isinstance(value, list | tuple):
        filled_items = [_ports(v, with_port, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(filled_items) if isinstance(value, tuple) else filled_items
    return value


def _argv(issues: Issues, text: str | None, where: str) -> tuple[str, ...] | None:
    if text is None:
        return None
    try:
        return tuple(split_args(text))
    except ValueError as exc:
        issues.error(where, f"cannot split into arguments: {exc}")
        return None


def _proxy(issues: Issues, m: RawModel, expander: Expander, port: int | None, path: str) -> str:
    where = f"{path}.proxy"
    text = expand(issues, expander, m.proxy if m.proxy is not None else DEFAULT_PROXY, where)
    if text is None:
        return ""
    if PORT_REF in text:
        if port is None:
            if m.proxy is None:
                issues.error(
                    where,
                    f"not set, and the default {DEFAULT_PROXY} needs cmd to use ${{PORT}}; "
                    "set proxy to the URL the upstream listens on",
                )
            else:
                issues.error(where, "uses ${PORT} but cmd does not use ${PORT}")
            return ""
        text = text.replace(PORT_REF, str(port))
    return http_url(issues, text, where)


def _aliases(issues: Issues, m: RawModel, path: str, by_id: list[str]) -> tuple[str, ...]:
    out: list[str] = []
    for i, alias in enumerate(m.aliases):
        where = f"{path}.aliases[{i}]"
        if isinstance(alias, RawAlias):
            for key in ("name", "unlisted"):
                if getattr(alias, key) is not None:
                    issues.warn(f"{where}.{key}", "ignored: aliases are names only")
            alias = alias.id
        if not alias.strip():
            issues.error(where, "an alias must not be empty")
            continue
        out.append(alias)
    # llama-swap: each setParamsByID key (but the model's own id) is an alias too.
    out += [k for k in by_id if k not in out]
    return tuple(out)


def _env(
    issues: Issues, m: RawModel, expander: Expander, with_port: WithPort, path: str
) -> dict[str, str]:
    env: dict[str, str] = {}
    for i, item in enumerate(m.env):
        where = f"{path}.env[{i}]"
        key, sep, value = item.partition("=")
        if not sep or not _ENV_KEY.match(key):
            issues.error(where, f"{item!r} is not KEY=VALUE with KEY a variable name")
            continue
        if key in env:
            issues.error(where, f"{key} is set twice")
            continue
        expanded = with_port(expand(issues, expander, value, where), where)
        env[key] = expanded if expanded is not None else ""
    return env


def _check_endpoint(
    issues: Issues, m: RawModel, expander: Expander, with_port: WithPort, path: str
) -> str | None:
    where = f"{path}.checkEndpoint"
    text = with_port(expand(issues, expander, m.check_endpoint, where), where)
    if text is None or text.strip() == "none":
        return None
    parts = urlsplit(text)
    if parts.scheme in ("http", "https") and parts.netloc:
        # llama-swap sends it through the model's proxy, which keeps only the path.
        path_only = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        issues.warn(where, f"{text!r} is checked on the model's proxy as {path_only!r}")
        return path_only
    if not text.startswith("/"):
        issues.error(where, f"{text!r} must be a path starting with / or `none`")
    return str(text)


def _ttl(issues: Issues, ttl: float | None, global_ttl: float, where: str) -> float:
    if ttl is None or ttl == -1:
        return global_ttl
    if ttl < 0 or not math.isfinite(ttl):
        issues.error(
            where, f"{ttl!r} is out of range; expected -1 (use globalTTL), 0 (never) or seconds"
        )
        return 0.0
    return float(ttl)


def _model_unload(issues: Issues, value: float | None, default: float, where: str) -> float:
    if value is None or value == 0:
        return default
    return non_negative(issues, value, where, "seconds >= 0 (0 = use unloadTimeout)")


def _set_params_by_id(
    issues: Issues, m: RawModel, expander: Expander, path: str
) -> dict[str, dict[str, Any]]:
    """Requested id -> params; macros expanded in the ids, as llama-swap does
    (`${MODEL_ID}:high`)."""
    out: dict[str, dict[str, Any]] = {}
    key_of: dict[str, str] = {}
    for key, given in m.filters.set_params_by_id.items():
        where = join_path(f"{path}.filters.setParamsByID", key)
        requested = (expand(issues, expander, key, where) or "").strip()
        if not requested:
            issues.error(where, "an id must not be empty")
            continue
        if requested in key_of:
            issues.error(
                where,
                f"resolves to {requested!r}, as {key_of[requested]!r} does; "
                "each key must be a distinct id",
            )
            continue
        key_of[requested] = key
        params = dict(given)
        if params.pop("model", None) is not None:
            issues.warn(f"{where}.model", "`model` cannot be set; ignored")
        out[requested] = params
    return out


def _concurrency(issues: Issues, value: int, scheduler: str, where: str) -> int:
    if value < 0:
        issues.error(where, f"{value} is out of range; expected an integer >= 0")
    return value if value > 0 else default_concurrency(scheduler)


MODALITIES: Final = ("text", "audio", "image")


def _capabilities(issues: Issues, raw: RawCapabilities, where: str) -> Capabilities:
    # llama-swap's ModelCapConfig.Validate.
    for key, listed in (("in", raw.in_), ("out", raw.out)):
        for i, modality in enumerate(listed):
            if modality not in MODALITIES:
                issues.error(
                    f"{where}.{key}[{i}]",
                    f"invalid modality {modality!r}; expected one of {', '.join(MODALITIES)}",
                )
    if raw.context < 0:
        issues.error(f"{where}.context", f"must be >= 0, got {raw.context}")
    return Capabilities(
        inputs=tuple(raw.in_),
        outputs=tuple(raw.out),
        tools=raw.tools,
        reranker=raw.reranker,
        context=max(0, raw.context),
    )


def _metadata(
    issues: Issues, value: Any, expander: Expander, with_port: WithPort, where: str
) -> Any:
    if isinstance(value, str):
        try:
            expanded = expander.expand_typed(value)
        except MacroError as exc:
            for location, message in exc.problems:
                issues.error(location or where, message)
            return value
        if expanded == PORT_REF:
            filled = with_port(expanded, where)
            return int(filled) if filled is not None else value
        return with_port(expanded, where) if isinstance(expanded, str) else expanded
    if isinstance(value, dict):
        return {
            k: _metadata(issues, v, expander, with_port, join_path(where, str(k)))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [
            _metadata(issues, v, expander, with_port, f"{where}[{i}]") for i, v in enumerate(value)
        ]
    return value
