"""Priority header parsing and band labels.

The number is the interface: callers compose band + per-user offset themselves,
so any signed integer is a valid priority and nothing is clamped.
"""

from __future__ import annotations

from typing import Final, Literal

Band = Literal["interactive", "normal", "batch"]

HEADER: Final = "X-LlamaSwap-Priority"

ALIASES: Final[dict[str, int]] = {"interactive": 100, "normal": 0, "batch": -100}

_ASCII_DIGITS: Final = frozenset("0123456789")


def parse_priority(value: str | None) -> int:
    """Parse an `X-LlamaSwap-Priority` value; anything unparseable is 0.

    Accepts an optional sign then ASCII digits (surrounding whitespace ignored),
    or an alias. `1e3`, `0x10`, non-ASCII digits and the empty string are 0:
    a malformed header must never fail a request or change its band by accident.
    """
    if value is None:
        return 0
    text = value.strip()
    alias = ALIASES.get(text.lower())
    if alias is not None:
        return alias
    digits = text[1:] if text[:1] in ("+", "-") else text
    # str.isdigit() accepts non-ASCII digits such as "٣"; the header is ASCII only.
    if not digits or not set(digits) <= _ASCII_DIGITS:
        return 0
    try:
        return int(text)
    except ValueError:  # more digits than int() converts (sys.int_max_str_digits, 4300)
        return 0


def band_of(priority: int) -> Band:
    """Band label used in metrics and reports: >= 50 interactive, <= -50 batch."""
    if priority >= 50:
        return "interactive"
    if priority <= -50:
        return "batch"
    return "normal"
