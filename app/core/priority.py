"""Priority header parsing and band labels.

The number is the interface: callers compose band + per-user offset themselves,
so any signed 64-bit integer is a valid priority and nothing is clamped. Wider
values parse as 0, as in the llama-swap fork (a 64-bit parse; unparseable is 0):
that bound is also what keeps the score's floats finite and every priority
storable in SQLite's INTEGER.
"""

from __future__ import annotations

from typing import Final, Literal

Band = Literal["interactive", "normal", "batch"]

HEADER: Final = "X-LlamaSwap-Priority"

ALIASES: Final[dict[str, int]] = {"interactive": 100, "normal": 0, "batch": -100}

_ASCII_DIGITS: Final = frozenset("0123456789")

MIN_PRIORITY: Final = -(2**63)
MAX_PRIORITY: Final = 2**63 - 1

# Both bounds have 19 digits; more after the leading zeros is out of range, so
# int() never sees (or spends time on) thousands of digits.
_MAX_DIGITS: Final = len(str(MAX_PRIORITY))


def parse_priority(value: str | None) -> int:
    """Parse an `X-LlamaSwap-Priority` value; anything unparseable is 0.

    Accepts an optional sign then ASCII digits (surrounding whitespace ignored),
    or an alias. `1e3`, `0x10`, non-ASCII digits, the empty string and values
    outside [-2^63, 2^63 - 1] are 0: a malformed header must never fail a
    request or change its band by accident.
    """
    if value is None:
        return 0
    text = value.strip()
    alias = ALIASES.get(text.lower())
    if alias is not None:
        return alias
    negative = text[:1] == "-"
    digits = text[1:] if text[:1] in ("+", "-") else text
    # str.isdigit() accepts non-ASCII digits such as "٣"; the header is ASCII only.
    if not digits or not set(digits) <= _ASCII_DIGITS:
        return 0
    significant = digits.lstrip("0") or "0"
    if len(significant) > _MAX_DIGITS:
        return 0
    number = -int(significant) if negative else int(significant)
    return number if MIN_PRIORITY <= number <= MAX_PRIORITY else 0


def band_of(priority: int) -> Band:
    """Band label used in metrics and reports: >= 50 interactive, <= -50 batch."""
    if priority >= 50:
        return "interactive"
    if priority <= -50:
        return "batch"
    return "normal"
