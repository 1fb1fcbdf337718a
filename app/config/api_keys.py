"""Resolving `apiKeys`: llama-swap's plain strings (admin keys) and gpulane's
mappings with a label, a role and a priority policy.

Keys are compared as given and never printed, since errors end up in logs.
A priority setting reads with the core's grammar (`read_priority_setting`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from app.config.callers import CALLER_LABEL_RULE, ROLES, is_caller_label
from app.config.checks import Issues
from app.config.macros import Expander, MacroValue, expand
from app.config.raw import RawApiKey, RawConfig
from app.config.resolved import ApiKey
from app.config.values import at_least_one, choice
from app.core.priority import (
    MAX_PRIORITY,
    MIN_PRIORITY,
    SETTING_FORMS,
    read_priority_setting,
    tier_offset,
)

MAX_WEIGHT: Final = 1000
"""Weights are ratios between callers; a larger one is a typo."""


def resolve_api_keys(
    raw: RawConfig,
    issues: Issues,
    environ: Mapping[str, str],
    origins: Mapping[str, str],
) -> tuple[ApiKey, ...]:
    macros: Mapping[str, MacroValue] = raw.macros
    expander = Expander(macros, environ=environ, origins=origins)
    tier_span = raw.routing.scheduler.settings.serial.tier_span
    keys: list[ApiKey] = []
    key_at: dict[str, int] = {}
    label_at: dict[str, int] = {}
    for i, entry in enumerate(raw.api_keys):
        where = f"apiKeys[{i}]"
        mapping = entry if isinstance(entry, RawApiKey) else None
        key_where = where if mapping is None else f"{where}.key"
        text = entry.key if isinstance(entry, RawApiKey) else entry
        key = expand(issues, expander, text, key_where)
        if key is not None and not key.strip():
            issues.error(key_where, "an API key must not be empty")
            key = None
        elif key is not None and key != key.strip():
            # Bearer, Basic and x-api-key values are trimmed before they are compared.
            issues.error(
                key_where,
                "an API key must not start or end with whitespace (it could never be presented)",
            )
            key = None
        elif key is not None and " " in key:
            issues.error(key_where, "an API key must not contain spaces (llama-swap refuses them)")
            key = None
        if key is not None:
            if key in key_at:
                issues.error(
                    key_where,
                    f"the same key as apiKeys[{key_at[key]}]; every key must be unique",
                )
            key_at.setdefault(key, i)
        api_key = _api_key(issues, mapping, key or "", i, where, tier_span)
        first = label_at.get(api_key.label)
        if first is not None:
            issues.error(
                f"{where}.label",
                f"{api_key.label!r} is already the label of apiKeys[{first}]; "
                "labels must be unique",
            )
        label_at.setdefault(api_key.label, i)
        if key is not None:
            keys.append(api_key)
    return tuple(keys)


def priority_setting(issues: Issues, value: int | str | None, where: str) -> int | None:
    """maxPriority/defaultPriority: an integer, a band, or a band plus an offset."""
    if value is None:
        return None
    if isinstance(value, str):
        number = read_priority_setting(value)
        if number is None:
            issues.error(where, f"{value!r} is not a priority; expected {SETTING_FORMS}")
            return None
    else:
        number = value
    if not MIN_PRIORITY <= number <= MAX_PRIORITY:
        issues.error(where, f"{number} is out of range; expected -2^63..2^63-1")
        return None
    return number


def _api_key(
    issues: Issues, raw: RawApiKey | None, key: str, i: int, where: str, tier_span: int
) -> ApiKey:
    # A plain string (llama-swap) is an admin key labelled by its position.
    if raw is None:
        return ApiKey(key=key, label=f"key#{i + 1}", role="admin")
    label = f"key#{i + 1}" if raw.label is None else raw.label
    if not is_caller_label(label):
        issues.error(
            f"{where}.label", f"{label!r} is not a caller label; expected {CALLER_LABEL_RULE}"
        )
    role = choice(issues, raw.role or "user", f"{where}.role", ROLES)
    cap = priority_setting(issues, raw.max_priority, f"{where}.maxPriority")
    default = priority_setting(issues, raw.default_priority, f"{where}.defaultPriority")
    if cap is not None and default is not None and default > cap:
        issues.error(
            f"{where}.defaultPriority",
            f"{default} is above maxPriority {cap}; every request without a header "
            "would be lowered",
        )
    if not 1 <= raw.weight <= MAX_WEIGHT:
        issues.error(
            f"{where}.weight",
            f"{raw.weight} is out of range; expected an integer 1..{MAX_WEIGHT}",
        )
    for value, setting in ((cap, "maxPriority"), (default, "defaultPriority")):
        # A warning, not an error: an uncapped caller may send any number
        # anyway; the band check is sized by tierSpan.
        if value is not None and not 0 <= tier_offset(value) <= tier_span:
            issues.warn(
                f"{where}.{setting}",
                f"{value} is {tier_offset(value):+d} from its band's base, outside "
                f"0..tierSpan ({tier_span}, routing.scheduler.settings.serial.tierSpan): "
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
            else at_least_one(issues, raw.max_queued, f"{where}.maxQueued")
        ),
    )
