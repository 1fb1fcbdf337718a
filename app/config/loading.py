"""Reading a YAML config file (or a directory of them) into a `Config`, every
problem reported at once.

The text is parsed strictly (duplicate keys are errors), its macros are
substituted as llama-swap does (`substitution`), it is checked against the raw
Structs by `Walker`, decoded, then resolved; the errors of every stage are
collected before `ConfigError` is raised.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import yaml

from app.config.checks import INVALID, Issues, Walker, kind_of
from app.config.directory import config_files, merge_documents
from app.config.environment import config_environ
from app.config.raw import IGNORED_KEYS, LENIENT_STRUCTS, OPEN_STRUCTS, RawConfig
from app.config.resolution import Resolver
from app.config.resolved import Config, config_hash
from app.config.substitution import substitute


class ConfigError(Exception):
    """Every problem found in a config, one message per entry."""

    def __init__(self, errors: list[str], source: str = "<string>") -> None:
        self.errors = errors
        self.source = source
        super().__init__("\n".join(errors))


def load_config(path: str | os.PathLike[str], environ: Mapping[str, str] | None = None) -> Config:
    """The config in the file PATH, or, when PATH is a directory, in its
    `*.yml`/`*.yaml` files merged as llama-swap's `-config-dir` merges them
    (`app.config.directory`)."""
    source = os.fspath(path)
    if not Path(path).is_dir():
        return parse_config(_read(Path(path), source), source=source, environ=environ)
    try:
        files = config_files(Path(path))
    except OSError as exc:
        raise ConfigError([f"{source}: cannot read config directory: {exc}"], source) from exc
    if not files:
        raise ConfigError([f"{source}: no configuration files (*.yml, *.yaml) found"], source)
    issues = Issues()
    documents = []
    for file in files:
        data = _load_yaml(_read(file, source), str(file), issues)
        if data is not None:
            documents.append((str(file), data))
    merged = merge_documents(documents, issues) if not issues.errors else None
    return _build(merged, source, environ, issues)


def _read(file: Path, source: str) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{file}: cannot read config: {exc}"], source) from exc


def parse_config(
    text: str, *, source: str = "<string>", environ: Mapping[str, str] | None = None
) -> Config:
    issues = Issues()
    return _build(_load_yaml(text, source, issues), source, environ, issues)


def _build(
    data: dict[str, Any] | None,
    source: str,
    environ: Mapping[str, str] | None,
    issues: Issues,
) -> Config:
    # GPULANE_CACHE has its default (app/config/environment.py).
    env = config_environ(os.environ if environ is None else environ)
    if data is not None:
        data = substitute(data, env, issues)
    raw = _decode(data, issues) if data is not None else None
    if raw is None:
        raise ConfigError(issues.final_errors(), source)
    config = Resolver(raw, data or {}, issues, env).run()
    if issues.errors:
        raise ConfigError(issues.final_errors(), source)
    config = msgspec.structs.replace(config, warnings=tuple(issues.warnings), source=source)
    return msgspec.structs.replace(config, config_hash=config_hash(config))


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
        return {}  # llama-swap loads an empty file; resolution warns it serves nothing
    if not isinstance(data, dict):
        issues.error(source, f"expected a mapping at the top level, got {kind_of(data)}")
        return None
    return data


def _decode(data: dict[str, Any], issues: Issues) -> RawConfig | None:
    walker = Walker(issues, IGNORED_KEYS, OPEN_STRUCTS, LENIENT_STRUCTS)
    cleaned = walker.struct(data, RawConfig, "")
    if cleaned is INVALID:
        return None
    try:
        # The walker reported every problem and dropped bad values; this
        # decode is the authoritative one and should not fail.
        return msgspec.convert(cleaned, RawConfig)
    except msgspec.ValidationError as exc:
        issues.error("", f"config does not decode: {exc}")
        return None
