"""llama-swap's `-config-dir`: the top-level `*.yml`/`*.yaml` files of a
directory, merged in file-name order into one document (its
`internal/config/merge.go`), which is then loaded as one file is.

The rules, llama-swap's: mappings merge key by key; lists are concatenated;
equal scalars agree and a null yields to the other side; two different values
for one key are an error naming the key and the file. The children of
`models`, `groups`, `profiles`, `selectors`, `peers`, `matrix` and
`routing.router.settings.groups`/`.matrix` name discrete entities: one defined
in two files is an error even when both definitions agree. Each file is parsed
on its own, so a YAML anchor serves only the file that defines it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from app.config.checks import Issues, kind_of

IDENTITY_MAPS: Final = frozenset(
    {
        "models",
        "groups",
        "profiles",
        "selectors",
        "peers",
        "matrix",
        "routing.router.settings.groups",
        "routing.router.settings.matrix",
    }
)
"""Dotted paths whose children are entities: a child in two files is a duplicate."""


def config_files(directory: Path) -> list[Path]:
    """The directory's own `*.yml` and `*.yaml` files (no subdirectories), by name."""
    return sorted(
        (p for p in directory.iterdir() if p.suffix in (".yml", ".yaml") and not p.is_dir()),
        key=lambda p: p.name,
    )


def merge_documents(
    documents: list[tuple[str, dict[str, Any]]], issues: Issues
) -> dict[str, Any] | None:
    """The files' top-level mappings (source name, data) merged in order; None
    when a conflict was reported. An empty file (an empty mapping) adds nothing."""
    merged: dict[str, Any] = {}
    ok = True
    for source, data in documents:
        ok = _merge_mapping(merged, data, "", source, issues) and ok
    return merged if ok else None


def _merge_mapping(
    into: dict[str, Any], new: dict[str, Any], path: str, source: str, issues: Issues
) -> bool:
    ok = True
    for key, value in new.items():
        child = f"{path}.{key}" if path else str(key)
        if key not in into:
            into[key] = value
        elif child in IDENTITY_MAPS:
            ok = _merge_entities(into[key], value, child, source, issues) and ok
        else:
            merged = _merge_value(into[key], value, child, source, issues)
            if merged is _CONFLICT:
                ok = False
            else:
                into[key] = merged
    return ok


def _merge_entities(into: Any, new: Any, path: str, source: str, issues: Issues) -> bool:
    # llama-swap wants mappings on both sides: an empty `models:` (null) conflicts too.
    if not isinstance(into, dict) or not isinstance(new, dict):
        issues.error(path, f"conflict: expected a mapping, introduced by {source}")
        return False
    ok = True
    name = path.rsplit(".", 1)[-1]
    for key, value in new.items():
        if key in into:
            issues.error(
                f"{path}.{key}",
                f"duplicate {name} {key!r} found in {source} "
                "(already defined in another config file)",
            )
            ok = False
        else:
            into[key] = value
    return ok


_CONFLICT: Final = object()


def _merge_value(into: Any, new: Any, path: str, source: str, issues: Issues) -> Any:
    if isinstance(into, dict) and isinstance(new, dict):
        return into if _merge_mapping(into, new, path, source, issues) else _CONFLICT
    if isinstance(into, list) and isinstance(new, list):
        return into + new
    if into is None:
        return new
    if new is None:
        return into
    if isinstance(into, (dict, list)) or isinstance(new, (dict, list)):
        issues.error(
            path,
            f"conflict: {source} gives {kind_of(new)} where a previous file gives {kind_of(into)}",
        )
        return _CONFLICT
    if type(into) is type(new) and into == new:
        return into
    issues.error(
        path, f"conflict: {source} sets {new!r}, a previous file {into!r}; set it in one file"
    )
    return _CONFLICT
