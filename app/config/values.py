"""Checks of one config value: durations, time limits, choices and ranges.

Each is a plain function: it reports a bad value to `issues` (naming the key,
the value and what is allowed) and returns what to use instead, so resolution
goes on and every problem is found in one pass.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from typing import Final, NamedTuple

from app.config.checks import Issues

DURATION_FORMS: Final = 'a duration like "7d", "12h", "30m", "45s" or "1d12h"'
_DURATION: Final = re.compile(r"^(?:\d+(?:\.\d+)?[dhms])+$")
_DURATION_PART: Final = re.compile(r"(\d+(?:\.\d+)?)([dhms])")
_DURATION_UNITS: Final = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


class RunLimits(NamedTuple):
    """The top-level limits on one forwarded request: every model's default."""

    max_run_time: float | None
    stream_idle_timeout: float | None


def seconds(
    issues: Issues, value: float | str, where: str, allowed: str, *, positive: bool = False
) -> float | None:
    """Seconds from a number or a duration string; None (and an error) if bad."""
    if isinstance(value, str):
        text = value.strip()
        if not _DURATION.match(text):
            issues.error(where, f"{value!r} is not a duration; expected {allowed}")
            return None
        total = sum(float(n) * _DURATION_UNITS[unit] for n, unit in _DURATION_PART.findall(text))
    else:
        total = float(value)
    if not math.isfinite(total) or total < 0 or (positive and total == 0):
        issues.error(where, f"{show_number(value)} is out of range; expected {allowed}")
        return None
    return total


def limit(
    issues: Issues,
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
        allowed += f", or {DURATION_FORMS}"
    total = seconds(issues, value, where, allowed)
    if total is None:
        return default
    return total or None


def choice(issues: Issues, value: str, where: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        issues.error(where, f"{value!r} is not allowed; expected one of {', '.join(allowed)}")
    return value


def positive(issues: Issues, value: float, where: str, allowed: str) -> float:
    if not math.isfinite(value) or value <= 0:
        issues.error(where, f"{value!r} is out of range; expected {allowed}")
    return float(value)


def non_negative(issues: Issues, value: float, where: str, allowed: str) -> float:
    if not math.isfinite(value) or value < 0:
        issues.error(where, f"{value!r} is out of range; expected {allowed}")
        return 0.0
    return float(value)


def at_least_one(issues: Issues, value: int, where: str) -> int:
    if value < 1:
        issues.error(where, f"{value} is out of range; expected an integer >= 1")
        return 1
    return value


def unknown_model(name: str, index: Mapping[str, str], outcome: str = "") -> str:
    """The message for a name that is no model id or alias, with the closest one."""
    close = difflib.get_close_matches(name, list(index), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown model {name!r}{outcome}{hint}"


def show_number(value: float | str) -> str:
    # YAML's -1 arrives as -1.0 through a float field; show it as written.
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)
