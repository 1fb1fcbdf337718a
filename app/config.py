"""Strict, llama-swap compatible configuration.

A YAML file is decoded into raw msgspec Structs shaped like the file (camelCase
keys), then resolved into `Config`/`ModelConfig`: macros expanded, ports
assigned, defaults merged. Every problem is collected before failing, so a user
fixes a config in one pass; llama-swap keys that mean nothing to a
one-model-at-a-time scheduler load with a warning instead of an error, so an
existing llama-swap config keeps working.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import yaml

from app.config_check import INVALID, Issues, Walker, kind_of
from app.config_raw import (
    DEFAULT_AGING_DIVISOR,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_DATABASE_PATH,
    DEFAULT_HEALTH_CHECK_TIMEOUT,
    DEFAULT_IGNORE_PATHS,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_RUN_TIME,
    DEFAULT_RESPONSE_HEADER_TIMEOUT,
    DEFAULT_RESULT_RETENTION_S,
    DEFAULT_SHUTDOWN_GRACE,
    DEFAULT_START_PORT,
    DEFAULT_STREAM_IDLE_TIMEOUT,
    DEFAULT_SWAP_AFFINITY_BONUS,
    DEFAULT_UNLOAD_TIMEOUT,
    IGNORED_KEYS,
    OPEN_STRUCTS,
    RawAlias,
    RawCompat,
    RawConfig,
    RawDatabase,
    RawFifo,
    RawFilters,
    RawHooks,
    RawJobs,
    RawModel,
    RawOnStartup,
    RawRouting,
    RawScheduler,
    RawSchedulerSettings,
    RawSerial,
    RawServer,
    RawTimeouts,
    RawUpstream,
)
from app.config_resolved import Config, ModelConfig
from app.config_resolver import (
    DEFAULT_CONCURRENCY_LIMIT,
    DEFAULT_PROXY,
    LOG_LEVELS,
    MAX_AGING_DECIMALS,
    NEVER_MATCHES,
    SCHEDULERS,
    SYNCHRONOUS,
    Resolver,
)

# What other modules import from here; the pieces live in app.config_*.
__all__ = [
    "DEFAULT_AGING_DIVISOR",
    "DEFAULT_CONCURRENCY_LIMIT",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_DATABASE_PATH",
    "DEFAULT_HEALTH_CHECK_TIMEOUT",
    "DEFAULT_IGNORE_PATHS",
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_RUN_TIME",
    "DEFAULT_PROXY",
    "DEFAULT_RESPONSE_HEADER_TIMEOUT",
    "DEFAULT_RESULT_RETENTION_S",
    "DEFAULT_SHUTDOWN_GRACE",
    "DEFAULT_START_PORT",
    "DEFAULT_STREAM_IDLE_TIMEOUT",
    "DEFAULT_SWAP_AFFINITY_BONUS",
    "DEFAULT_UNLOAD_TIMEOUT",
    "IGNORED_KEYS",
    "LOG_LEVELS",
    "MAX_AGING_DECIMALS",
    "NEVER_MATCHES",
    "SCHEDULERS",
    "SYNCHRONOUS",
    "Config",
    "ConfigError",
    "ModelConfig",
    "RawAlias",
    "RawCompat",
    "RawConfig",
    "RawDatabase",
    "RawFifo",
    "RawFilters",
    "RawHooks",
    "RawJobs",
    "RawModel",
    "RawOnStartup",
    "RawRouting",
    "RawScheduler",
    "RawSchedulerSettings",
    "RawSerial",
    "RawServer",
    "RawTimeouts",
    "RawUpstream",
    "config_hash",
    "load_config",
    "masked",
    "parse_config",
]


class ConfigError(Exception):
    """Every problem found in a config, one message per entry."""

    def __init__(self, errors: list[str], source: str = "<string>") -> None:
        self.errors = errors
        self.source = source
        super().__init__("\n".join(errors))


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
    issues = Issues()
    data = _load_yaml(text, source, issues)
    raw = _decode(data, issues) if data is not None else None
    if raw is None:
        raise ConfigError(issues.final_errors(), source)
    config = Resolver(raw, data or {}, issues, os.environ if environ is None else environ).run()
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


def _load_yaml(text: str, source: str, issues: Issues) -> dict[str, Any] | None:
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
        issues.error(source, f"expected a mapping at the top level, got {kind_of(data)}")
        return None
    return data


def _decode(data: dict[str, Any], issues: Issues) -> RawConfig | None:
    walker = Walker(issues, IGNORED_KEYS, OPEN_STRUCTS)
    cleaned = walker.struct(data, RawConfig, "")
    if not isinstance(data.get("models"), dict) or not data["models"]:
        if "models" in data:
            issues.error("models", "expected a mapping of at least one model id to its settings")
        else:
            issues.error("models", "required: at least one model")
    if cleaned is INVALID:
        return None
    try:
        # The walker reported every problem and dropped bad values; this
        # decode is the authoritative one and should not fail.
        return msgspec.convert(cleaned, RawConfig)
    except msgspec.ValidationError as exc:
        issues.error("", f"config does not decode: {exc}")
        return None
