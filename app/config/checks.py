"""Checking raw YAML data against msgspec Structs, collecting every error.

msgspec stops at the first problem; `Walker` reports them all, suggests the
known key an unknown one is probably a typo of, and returns the data minus
what failed so a final msgspec decode succeeds.
"""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Mapping
from typing import Any, Final, Union, get_args, get_origin

import msgspec


class Issues:
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


INVALID: Final = object()
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


class Walker:
    """Checks raw YAML data against the raw Structs, collecting every error
    (msgspec stops at the first) and returning the data minus what failed."""

    def __init__(
        self,
        issues: Issues,
        ignored_keys: Mapping[type, Mapping[str, str]],
        open_structs: Mapping[type, str],
        lenient_structs: Mapping[type, re.Pattern[str]] | None = None,
    ) -> None:
        self.issues = issues
        # Per struct: keys accepted with a warning, and why.
        self.ignored_keys = ignored_keys
        # Structs whose unknown keys warn rather than fail, unless a typo.
        self.open_structs = open_structs
        # Structs whose unknown keys warn unless one edit from a known key; the
        # pattern names keys skipped without a word (YAML anchor blocks).
        self.lenient_structs = lenient_structs or {}

    def value(self, value: Any, typ: Any, path: str) -> Any:
        if _is_struct(typ):
            return self.struct(value, typ, path)
        origin = get_origin(typ)
        if origin is dict:
            if not isinstance(value, dict):
                self.issues.error(path, f"expected a mapping, got {_show(value)}")
                return INVALID
            _, item_type = get_args(typ)
            out: dict[str, Any] = {}
            for key, item in value.items():
                if not isinstance(key, str):
                    self.issues.error(path, f"key {key!r} must be a string; quote it")
                    continue
                checked = self.value(item, item_type, join_path(path, key))
                if checked is not INVALID:
                    out[key] = checked
            return out
        if origin is list:
            if not isinstance(value, list):
                self.issues.error(path, f"expected a list, got {_show(value)}")
                return INVALID
            (item_type,) = get_args(typ)
            items = [self.value(item, item_type, f"{path}[{i}]") for i, item in enumerate(value)]
            return [item for item in items if item is not INVALID]
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
            return INVALID
        return value

    def struct(self, value: Any, cls: type[msgspec.Struct], path: str) -> Any:
        if not isinstance(value, dict):
            self.issues.error(path, f"expected a mapping, got {_show(value)}")
            return INVALID
        fields = {f.encode_name: f for f in msgspec.structs.fields(cls)}
        ignored = self.ignored_keys.get(cls, {})
        out: dict[str, Any] = {}
        invalid_required = False
        for key, item in value.items():
            key_path = join_path(path, str(key))
            if not isinstance(key, str):
                self.issues.error(path, f"key {key!r} must be a string; quote it")
                continue
            field = fields.get(key)
            if field is not None:
                if item is None and _is_container(field.type):
                    continue  # `macros:` with every entry commented out
                checked = self.value(item, field.type, key_path)
                if checked is not INVALID:
                    out[key] = checked
                elif field.required:
                    invalid_required = True
            elif key in ignored:
                self.issues.warn(key_path, f"llama-swap key ignored: {ignored[key]}")
            elif cls in self.lenient_structs:
                near = _near_miss(key, [*fields, *ignored])
                if near is not None:
                    self.issues.error(key_path, f"unknown key; did you mean {near!r}?")
                elif not self.lenient_structs[cls].fullmatch(key):
                    self.issues.warn(key_path, "unknown key ignored, as llama-swap ignores it")
            else:
                close = _closest(key, [*fields, *ignored])
                if cls in self.open_structs and close is None:
                    self.issues.warn(key_path, f"llama-swap key ignored: {self.open_structs[cls]}")
                else:
                    self.issues.error(key_path, _unknown_key(close, fields, ignored))
        missing = [name for name, f in fields.items() if f.required and name not in value]
        for name in missing:
            self.issues.error(join_path(path, name), "required key is missing")
        return INVALID if missing or invalid_required else out


def _is_struct(typ: Any) -> bool:
    return isinstance(typ, type) and issubclass(typ, msgspec.Struct)


def _is_container(typ: Any) -> bool:
    return _is_struct(typ) or get_origin(typ) in (dict, list)


def join_path(path: str, key: str) -> str:
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


def _near_miss(key: str, known: list[str]) -> str | None:
    """The known key `key` is a typo of: the same but for case and `_`/`-`, or one
    edit away (a letter added, dropped, changed, or two swapped)."""
    folded = {k.lower().replace("_", "").replace("-", ""): k for k in known}
    exact = folded.get(key.lower().replace("_", "").replace("-", ""))
    if exact is not None:
        return exact
    return next((k for k in known if _one_edit(key, k)), None)


def _one_edit(a: str, b: str) -> bool:
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or (
            len(diff) == 2
            and diff[1] == diff[0] + 1
            and a[diff[0]] == b[diff[1]]
            and a[diff[1]] == b[diff[0]]
        )
    short, long = sorted((a, b), key=len)
    i = next((i for i in range(len(short)) if short[i] != long[i]), len(short))
    return short[i:] == long[i + 1 :]


def _unknown_key(close: str | None, fields: Mapping[str, Any], ignored: Mapping[str, str]) -> str:
    if close is not None:
        return f"unknown key; did you mean {close!r}?"
    known = []
    if fields:
        known.append(f"allowed keys: {', '.join(sorted(fields))}")
    if ignored:
        known.append(f"llama-swap keys accepted and ignored: {', '.join(sorted(ignored))}")
    return "unknown key; " + "; ".join(known)


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


def kind_of(value: Any) -> str:
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
    return f"{text} ({kind_of(value)})"
