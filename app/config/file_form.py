"""A resolved config written back as its file would spell it.

`gpulane check-config --format yaml|json` prints this: the file's own keys
(camelCase, as in llama-swap and config.example.yaml), every macro
substituted and every default filled in, secrets masked. It loads back as the
same config: each model states what it inherited (its `ttl`, `unloadTimeout`,
`maxRunTime`...), so the top-level keys that only feed models (`macros`,
`globalTTL`) are left out. Values gpulane derives and no file key sets (a
model's `port`, the config's hash, the name index) are left out too
(`DERIVED`): the `cmd` and `proxy` printed already hold the port.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from typing import Any, Final

import sqlalchemy

from app.config.matrix import is_name_char
from app.config.peers import CHOICE_GROUP, PEER_GROUP
from app.config.resolved import ApiKey, Config, ModelConfig
from app.config.sleep import SleepSpec
from app.core.residency import DEFAULT_GROUP, GroupRouter, MemoryRouter, Router

SECRET: Final = "***"

DERIVED: Final = {
    Config: frozenset({"aging_divisor_ns", "warnings", "config_hash", "source", "name_index"}),
    ModelConfig: frozenset({"id", "port", "peer", "headers", "choices"}),
}
"""Fields of the resolved config no file key sets (a model's id is its key;
a peer's entries are its `peers` entry)."""


def file_form(config: Config) -> dict[str, Any]:
    """`config` as a config file would say it (see the module's docstring)."""
    own = {k: m for k, m in config.models.items() if m.peer is None and not m.choices}
    peer_entries = [m for m in config.models.values() if m.peer is not None]
    serial: dict[str, Any] = {
        "agingDivisor": config.aging_divisor,
        "swapAffinityBonus": config.swap_affinity_bonus,
        "fairShareBonus": config.fair_share_bonus,
        "shortJobBonus": config.short_job_bonus,
        "tierSpan": config.tier_span,
    }
    settings: dict[str, Any] = {"serial": serial}
    fifo = {k: m.fifo_priority for k, m in own.items() if m.fifo_priority}
    if config.scheduler == "fifo" and fifo:
        settings["fifo"] = {"priority": fifo}
    routing: dict[str, Any] = {"scheduler": {"use": config.scheduler, "settings": settings}}
    router = None if config.router is None else _router(config.router, set(config.peers))
    if router is not None:
        routing["router"] = router
    out: dict[str, Any] = {
        "healthCheckTimeout": config.health_check_timeout,
        "logLevel": config.log_level,
        "logRequests": config.log_requests,
        "startPort": config.start_port,
        "sendLoadingState": config.send_loading_state,
        "includeAliasesInList": config.include_aliases_in_list,
    }
    if peer_entries:  # models state their own; peers use these
        out["maxRunTime"] = _limit(peer_entries[0].max_run_time)
        out["streamIdleTimeout"] = _limit(peer_entries[0].stream_idle_timeout)
    out |= {
        "shutdownGrace": config.shutdown_grace,
        "loadBackoff": config.load_backoff,
        "loadBackoffMax": config.load_backoff_max,
        "memoryReleaseWait": config.memory_release_wait,
        "loadFailureLimit": config.load_failure_limit,
        "maxQueued": config.max_queued,
        "maxQueuedPerCaller": config.max_queued_per_caller,
        **(
            {}
            if config.sleep_host_memory is None
            else {"sleepHostMemory": config.sleep_host_memory}
        ),
        "apiKeys": [_api_key(i, key) for i, key in enumerate(config.api_keys)],
        "hooks": {"on_startup": {"preload": list(config.preload)}},
        "routing": routing,
        "database": _database(config),
        "jobs": {
            "resultRetention": config.result_retention_s,
            "maxAttempts": config.max_attempts,
            "minFreeDisk": config.min_free_disk,
            "maxFileBytes": config.max_file_bytes,
            "maxStoredBytesPerCaller": config.max_stored_bytes_per_caller,
            "maxVideoBytes": config.max_video_bytes,
            **({"videoDir": config.video_dir} if config.video_dir is not None else {}),
        },
        "server": {
            "maxBodyBytes": config.max_body_bytes,
            "allowedHosts": list(config.allowed_hosts),
            "allowedOrigins": list(config.allowed_origins),
        },
        "upstream": {"ignorePaths": config.ignore_paths},
        "models": {k: _model(m) for k, m in own.items()},
    }
    if config.sleep_host_memory is not None:
        out["sleepHostMemory"] = config.sleep_host_memory
    if config.peers:
        out["peers"] = {
            name: _peer(pool.slots, [config.models[e] for e in pool.models])
            for name, pool in config.peers.items()
        }
    return out


def _limit(seconds: float | None) -> float:
    return 0 if seconds is None else seconds  # 0: no limit


def _args(argv: Iterable[str]) -> str:
    return shlex.join(argv)  # the file's cmd is split as a shell would (shlex)


def _model(m: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"cmd": _args(m.cmd)}
    if m.cmd_stop is not None:
        out["cmdStop"] = _args(m.cmd_stop)
    out |= {
        "proxy": m.proxy,
        "aliases": list(m.aliases),  # setParamsByID's ids among them: named twice is fine
        "env": [f"{k}={v}" for k, v in m.env.items()],
        "checkEndpoint": "none" if m.check_endpoint is None else m.check_endpoint,
        "ttl": m.ttl,
        "unloadTimeout": m.unload_timeout,
        "unlisted": m.unlisted,
        "useModelName": m.use_model_name or "",
        "name": m.name or "",
        "description": m.description or "",
        "filters": _filters(m),
        "concurrencyLimit": m.concurrency_limit,
        "metadata": m.metadata,
        "sendLoadingState": m.send_loading_state,
        "timeouts": _timeouts(m),
        "compat": {"ignoreWebsockets": m.ignore_websockets},
        **({"kind": m.kind} if m.kind is not None else {}),
        **({"outputDir": m.output_dir} if m.output_dir is not None else {}),
        "capabilities": {
            "in": list(m.capabilities.inputs),
            "out": list(m.capabilities.outputs),
            "tools": m.capabilities.tools,
            "reranker": m.capabilities.reranker,
            "context": m.capabilities.context,
        },
        "maxRunTime": _limit(m.max_run_time),
        "streamIdleTimeout": _limit(m.stream_idle_timeout),
        "passCredentials": list(m.pass_credentials),
    }
    if m.gpu_memory_mib is not None:
        out["gpuMemory"] = f"{m.gpu_memory_mib}MiB"
    if m.sleep is not None:
        out["sleep"] = _sleep(m.sleep)
    return out


def _sleep(spec: SleepSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if spec.preset == "custom":
        out |= {"sleep": str(spec.sleep[0]), "wake": str(spec.wake[0])}
        if spec.check is not None:
            out["check"] = str(spec.check)
    else:
        out["preset"] = spec.preset
        if spec.level is not None:
            out["level"] = spec.level
    return out | {
        "hostMemory": spec.host_memory,
        "timeout": spec.sleep_timeout,
        "wakeTimeout": spec.wake_timeout,
    }


def _filters(m: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"stripParams": list(m.strip_params), "setParams": m.set_params}
    if m.set_params_by_id:
        out["setParamsByID"] = m.set_params_by_id
    return out


def _timeouts(m: ModelConfig) -> dict[str, float]:
    return {
        "connect": _limit(m.connect_timeout),
        "responseHeader": _limit(m.response_header_timeout),
    }


def _peer(slots: int, entries: list[ModelConfig]) -> dict[str, Any]:
    first = entries[0]
    out: dict[str, Any] = {
        "proxy": first.proxy,
        "models": [e.use_model_name for e in entries],
    }
    if first.headers:
        out["apiKey"] = SECRET
    filters = _filters(first)
    filters.pop("setParamsByID", None)
    return out | {"filters": filters, "timeouts": _timeouts(first), "concurrencyLimit": slots}


def _api_key(i: int, key: ApiKey) -> str | dict[str, Any]:
    label = f"key#{i + 1}"  # what the file's position gives, unless it says otherwise
    secret = f"{SECRET}{i + 1}"  # masked, and still unique as keys must be
    if key == ApiKey(key=key.key, label=label, role="admin"):
        return secret  # a plain string, as llama-swap writes it
    out: dict[str, Any] = {"key": secret}
    if key.label != label:
        out["label"] = key.label
    out |= {
        "role": key.role,
        "maxPriority": key.max_priority,
        "defaultPriority": key.default_priority,
        "weight": key.weight,
        "maxQueued": key.max_queued,
    }
    return {k: v for k, v in out.items() if v is not None}


def _router(router: Router, peers: set[str]) -> dict[str, Any] | None:
    if isinstance(router, GroupRouter):
        # These groups come back by themselves: the models no group names, and
        # the peers' own.
        implied = {DEFAULT_GROUP} | {PEER_GROUP.format(p) for p in peers}
        if peers:
            implied.add(CHOICE_GROUP)
        groups = {
            g.name: {
                "swap": g.swap,
                "exclusive": g.exclusive,
                "persistent": g.persistent,
                "members": list(g.members),
            }
            for g in router.groups
            if g.name not in implied
        }
        return {"use": "group", "settings": {"groups": groups}} if groups else None
    if isinstance(router, MemoryRouter):
        memory = {"budget": f"{router.budget_mib}MiB", "sideBySide": router.side_by_side}
        return {"use": "memory", "settings": {"memory": memory}}
    models = sorted({m for s in router.sets for m in s.models} | router.evict_costs.keys())
    # A model id an expression cannot spell is named through a var.
    names = {m: m for m in models if m and all(is_name_char(c) for c in m)}
    variables: dict[str, str] = {}
    for model in models:
        if model not in names:
            var = f"m{len(variables) + 1}"
            while var in models:
                var += "."
            variables[var] = model
            names[model] = var
    sets: dict[str, list[str]] = {}
    for s in router.sets:  # expanded, in order: each entry its alternatives
        sets.setdefault(s.name, []).append(" & ".join(names[m] for m in sorted(s.models)))
    matrix: dict[str, Any] = {
        "vars": variables,
        "sets": {name: " | ".join(alternatives) for name, alternatives in sets.items()},
        "evict_costs": {names[m]: cost for m, cost in router.evict_costs.items()},
    }
    return {"use": "matrix", "settings": {"matrix": matrix}}


def _database(config: Config) -> dict[str, Any]:
    """`database` as the file spells it: a URL (its password masked, as every
    message masks it) or a path."""
    where: dict[str, Any]
    if "://" in config.database_path:
        url = sqlalchemy.make_url(config.database_path)
        where = {"url": url.render_as_string(hide_password=True)}
    else:
        where = {"path": config.database_path}
    return where | {
        "synchronous": config.database_synchronous,
        "leaseSeconds": config.database_lease_s,
    }
