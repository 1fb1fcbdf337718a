"""Priority header parsing, band labels, and the priority a caller is granted.

The number is the interface: callers compose band + per-user offset themselves,
so any signed 64-bit integer is a valid priority and nothing is clamped. Wider
values parse as 0, as in the llama-swap fork (a 64-bit parse; unparseable is 0):
that bound is also what keeps the score's floats finite and every priority
storable in SQLite's INTEGER.

What a request asks for is its header, else its body's OpenAI `service_tier`
(`requested_priority`); what it queues at is that, or its key's
`defaultPriority` when it asked for nothing, lowered to its key's
`maxPriority` (`grant`).
"""

from __future__ import annotations

import re
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


SERVICE_TIERS: Final[dict[str, int | None]] = {
    "priority": ALIASES["interactive"],
    "flex": ALIASES["batch"],
    "default": ALIASES["normal"],
    # OpenAI: "the tier the project is configured for", here the key's default.
    "auto": None,
}
"""OpenAI's `service_tier` values and the priority each asks for (None: nothing)."""


def parse_priority(value: str | None) -> int:
    """Parse an `X-LlamaSwap-Priority` value; anything unparseable is 0.

    Accepts an optional sign then ASCII digits (surrounding whitespace ignored),
    or an alias. `1e3`, `0x10`, non-ASCII digits, the empty string and values
    outside [-2^63, 2^63 - 1] are 0: a malformed header must never fail a
    request or change its band by accident.
    """
    number = read_priority(value)
    return 0 if number is None else number


def read_priority(value: str | None) -> int | None:
    """An `X-LlamaSwap-Priority` value as `parse_priority` reads it, or None
    when it asks for nothing (absent, empty or unparseable)."""
    if value is None:
        return None
    text = value.strip()
    alias = ALIASES.get(text.lower())
    if alias is not None:
        return alias
    negative = text[:1] == "-"
    digits = text[1:] if text[:1] in ("+", "-") else text
    # str.isdigit() accepts non-ASCII digits such as "٣"; the header is ASCII only.
    if not digits or not set(digits) <= _ASCII_DIGITS:
        # A band and an offset ("interactive+2"), as a config setting says it.
        number = read_priority_setting(text) if text[:1].isalpha() else None
        return number if number is not None and MIN_PRIORITY <= number <= MAX_PRIORITY else None
    significant = digits.lstrip("0") or "0"
    if len(significant) > _MAX_DIGITS:
        return None
    number = -int(significant) if negative else int(significant)
    return number if MIN_PRIORITY <= number <= MAX_PRIORITY else None


PRIORITY_FORMS: Final = (
    "a signed 64-bit integer, or interactive (+100), normal (0) or batch (-100), "
    "optionally + or - an integer (interactive+2)"
)
"""What an `X-LlamaSwap-Priority` header may say."""


ECHO_LENGTH: Final = 64
"""How much of an unreadable header is echoed back and logged (characters)."""


def unreadable_priority(value: str | None) -> str | None:
    """An `X-LlamaSwap-Priority` value that could not be read, as sent, or None
    when it was read, absent or blank. The request runs as if it asked for
    nothing (the seeds' rule) and is told so in `X-Gpulane-Priority-Requested`
    and `-Warning`, which echo this: its first `ECHO_LENGTH` characters, trimmed,
    anything but printable ASCII escaped (`\\xNN`), so no value, however long or
    odd, can break or add a response header."""
    if value is None or not value.strip() or read_priority(value) is not None:
        return None
    return "".join(c if " " <= c <= "~" else ascii(c)[1:-1] for c in value.strip()[:ECHO_LENGTH])


def priority_warning(sent: str) -> str:
    """What `X-Gpulane-Priority-Warning` says of an unreadable value
    (`unreadable_priority`'s): that it could not be read and what is allowed."""
    return (
        f"{HEADER} '{sent}' could not be read, so the request asked for no priority; "
        f"allowed: {PRIORITY_FORMS}"
    )


SETTING_FORMS: Final = (
    "an integer, interactive, normal or batch, optionally + or - an integer (interactive+2)"
)
"""What a config priority setting (an API key's maxPriority, defaultPriority) may be."""

# "interactive+2", "batch - 1", "normal", or an integer ("-98"): the header's
# grammar too (read_priority), which also bounds the number to 64 bits.
_SETTING: Final = re.compile(
    r"(?:(interactive|normal|batch)(?:\s*([+-])\s*(\d{1,20}))?|([+-]?\d{1,20}))",
    re.ASCII,  # \d is 0-9 only: no other script's digits
)


def read_priority_setting(text: str) -> int | None:
    """A config priority setting's number, or None when `text` is none of
    `SETTING_FORMS`. The range is not checked: the config says what is out of it."""
    match = _SETTING.fullmatch(text.strip().lower())
    if match is None:
        return None
    band, sign, offset, integer = match.groups()
    if integer is not None:
        return int(integer)
    return ALIASES[band] + (-1 if sign == "-" else 1) * int(offset or 0)


def tier_priority(tier: object) -> int | None:
    """The priority an OpenAI `service_tier` asks for; None when absent (null)
    or `auto`. ValueError for anything else, naming what is allowed."""
    if tier is None:
        return None
    if isinstance(tier, str) and tier in SERVICE_TIERS:
        return SERVICE_TIERS[tier]
    allowed = ", ".join(sorted(SERVICE_TIERS))
    raise ValueError(f"service_tier {tier!r} is not one of {allowed}")


def requested_priority(header: str | None, service_tier: object = None) -> int | None:
    """What a request asks for: its header, else its `service_tier`, else nothing."""
    asked = read_priority(header)
    return asked if asked is not None else tier_priority(service_tier)


def grant(requested: int | None, cap: int | None = None, default: int = 0) -> int:
    """The priority a request queues at: what it asked for (`default` when
    nothing), lowered to `cap` (the key's maxPriority; None = no cap)."""
    wanted = default if requested is None else requested
    return wanted if cap is None else min(wanted, cap)


BAND_STEP: Final = 100
"""Distance between the bands' bases (batch -100, normal 0, interactive 100)."""
DEFAULT_TIER_SPAN: Final = 2
"""The seeds' per-user offsets: free +0, pro +1, max +2."""


def tier_offset(priority: int) -> int:
    """A priority's offset from its band's base (`batch+2` is -98: offset 2)."""
    return priority - ALIASES[band_of(priority)]


def band_lift_error(bounded: dict[str, int], tier_span: int) -> str | None:
    """Why these bounded terms (config key -> most points) with offsets up to
    `tier_span` could lift a request into the next band, or None when they cannot:
    the top of a band (base + span + every bonus) must stay below the next base."""
    total = tier_span + sum(bounded.values())
    if total < BAND_STEP:
        return None
    terms = " + ".join(
        f"{key} {points}" for key, points in [*bounded.items(), ("tierSpan", tier_span)]
    )
    return (
        f"{terms} = {total} could lift a request into the next band; "
        f"together they may be at most {BAND_STEP - 1}"
    )


def band_of(priority: int) -> Band:
    """Band label used in metrics and reports: >= 50 interactive, <= -50 batch."""
    if priority >= 50:
        return "interactive"
    if priority <= -50:
        return "batch"
    return "normal"
