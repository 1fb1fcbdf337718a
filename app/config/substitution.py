"""llama-swap's macro pass over the YAML data, before it is checked.

llama-swap substitutes macros in the untyped YAML tree and only then decodes
it, so every value may use macros, and a value that is exactly one macro takes
the macro's type, in typed fields too (`startPort: ${FIRST_PORT}`,
`ttl: "${t}"`, `temperature: ${t}` sent upstream as the number). The global
macros apply to every top-level key but `models`; a model's values see its
`${MODEL_ID}`, the global macros and its own. Mapping keys stay literal, but
for `setParamsByID`'s, which resolution expands. `${PORT}` is left for
resolution, which assigns the ports, and `${PID}` for the runtime (cmdStop
only). An unknown macro left in a key gpulane reads is an error naming the
key, as in llama-swap.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from app.config.checks import Issues, join_path
from app.config.macros import (
    RESERVED,
    Expander,
    MacroError,
    MacroValue,
    check_macro_names,
    strip_comments,
)
from app.config.raw import IGNORED_KEYS, RawConfig

_ENV_REF: Final = re.compile(r"\$\{env\.([A-Za-z_][A-Za-z0-9_]*)\}")
_KNOWN: Final = frozenset(
    [f.encode_name for f in msgspec.structs.fields(RawConfig)] + list(IGNORED_KEYS[RawConfig])
)
_NOT_SUBSTITUTED: Final = frozenset({"macros", "models"})
_COMMANDS: Final = frozenset({"cmd", "cmdStop"})


def substitute(data: dict[str, Any], environ: Mapping[str, str], issues: Issues) -> dict[str, Any]:
    """`data` with its macros substituted; problems go to `issues`."""
    if isinstance(data.get("macros"), dict):
        check_macro_names(issues, data["macros"], "macros")
    macros = _scalars(data.get("macros"))
    origins = {name: join_path("macros", name) for name in macros}
    top = Expander(macros, environ=environ, origins=origins)
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in _NOT_SUBSTITUTED or not isinstance(key, str):
            out[key] = value
        elif key in _KNOWN:
            out[key] = _walk(value, top, key, issues)
        else:
            # Ignored by llama-swap and gpulane alike (anchor blocks such as
            # `defs:`); llama-swap still pastes the environment into them.
            _check_environment(value, environ, key, issues)
            out[key] = value
    models = data.get("models")
    if isinstance(models, dict):
        out["models"] = {
            model_id: _model(model_id, model, macros, origins, environ, issues)
            if isinstance(model_id, str) and isinstance(model, dict)
            else model
            for model_id, model in models.items()
        }
    return out


def _model(
    model_id: str,
    model: dict[str, Any],
    macros: Mapping[str, MacroValue],
    origins: Mapping[str, str],
    environ: Mapping[str, str],
    issues: Issues,
) -> dict[str, Any]:
    path = join_path("models", model_id)
    if isinstance(model.get("macros"), dict):
        check_macro_names(issues, model["macros"], f"{path}.macros")
    own = _scalars(model.get("macros"))
    table = {**macros, **own}
    scope = {**origins, **{name: join_path(f"{path}.macros", name) for name in own}}

    def expander(keep: frozenset[str]) -> Expander:
        return Expander(
            table, environ=environ, origins=scope, builtins={"MODEL_ID": model_id}, keep=keep
        )

    values = expander(frozenset({"PORT"}))
    # A model macro nothing uses is still checked, as llama-swap reads every one.
    check = expander(frozenset(RESERVED))
    for name in own:
        _expand(f"${{{name}}}", check, scope[name], issues)
    stop = expander(frozenset({"PORT", "PID"}))
    out: dict[str, Any] = {}
    for key, value in model.items():
        if key == "macros" or not isinstance(key, str):
            out[key] = value
        else:
            if key in _COMMANDS and isinstance(value, str):
                # A macro named in a comment must not expand into the command.
                value = strip_comments(value)
            where = join_path(path, key)
            out[key] = _walk(value, stop if key == "cmdStop" else values, where, issues)
    return out


def _walk(value: Any, expander: Expander, where: str, issues: Issues) -> Any:
    if isinstance(value, str):
        return _expand(value, expander, where, issues)
    if isinstance(value, dict):
        return {k: _walk(v, expander, join_path(where, str(k)), issues) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, expander, f"{where}[{i}]", issues) for i, v in enumerate(value)]
    return value


def _expand(text: str, expander: Expander, where: str, issues: Issues) -> Any:
    if "${" not in text:
        return text
    try:
        return expander.expand_typed(text)
    except MacroError as exc:
        for location, message in exc.problems:
            issues.error(location or where, message)
        return text


def _check_environment(value: Any, environ: Mapping[str, str], where: str, issues: Issues) -> None:
    if isinstance(value, str):
        for name in _ENV_REF.findall(value):
            if name not in environ:
                issues.error(
                    where, f"environment variable {name} is not set (used as ${{env.{name}}})"
                )
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_environment(v, environ, join_path(where, str(k)), issues)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_environment(v, environ, f"{where}[{i}]", issues)


def _scalars(macros: Any) -> dict[str, MacroValue]:
    """The well-formed entries of a `macros` block; the checks report the rest."""
    if not isinstance(macros, dict):
        return {}
    return {
        name: value
        for name, value in macros.items()
        if isinstance(name, str) and isinstance(value, str | int | float | bool)
    }
