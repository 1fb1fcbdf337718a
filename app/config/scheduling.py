"""Resolving `routing.scheduler`: which scheduler, fifo's per-model priorities,
and the serial scheduler's score terms (DESIGN.md, the scheduling policy).

The bounded terms are checked against the core's band rule, so no setting can
lift a request into the next band; the aging divisor must convert exactly to
integer nanoseconds, since decisions are compared in integers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from decimal import Decimal
from typing import Final

from app.config.checks import Issues, join_path
from app.config.raw import DEFAULT_AGING_DIVISOR, RawConfig, RawSerial
from app.config.values import unknown_model
from app.core.priority import BAND_STEP, band_lift_error
from app.core.scoring import DEFAULT_AGING_DIVISOR_NS
from app.core.state import FIFO

MAX_AGING_DECIMALS: Final = 9
SERIAL_SETTINGS: Final = "routing.scheduler.settings.serial"


def fifo_priorities(raw: RawConfig, issues: Issues) -> dict[str, int]:
    priorities = dict(raw.routing.scheduler.settings.fifo.priority)
    if priorities and raw.routing.scheduler.use != FIFO:
        issues.warn(
            "routing.scheduler.settings.fifo.priority",
            "only the fifo scheduler uses per-model priority; ignored by serial",
        )
    return priorities


def check_fifo_keys(
    issues: Issues, fifo: Mapping[str, int], declared: set[str], index: Mapping[str, str]
) -> None:
    """fifo's priorities name model ids: an alias or an unknown name is an error."""
    for name in fifo:
        where = join_path("routing.scheduler.settings.fifo.priority", name)
        if name in declared:
            continue
        owner = index.get(name)
        if owner is not None:
            issues.error(where, f"{name!r} is an alias; use the model id {owner!r}")
        else:
            issues.error(where, unknown_model(name, index))


def check_bands(issues: Issues, serial: RawSerial) -> None:
    """Each bounded term is 0..99, and together with the tier span they can
    never lift a request into the next band (aging alone crosses bands)."""
    bounded = {
        "swapAffinityBonus": serial.swap_affinity_bonus,
        "fairShareBonus": serial.fair_share_bonus,
        "shortJobBonus": serial.short_job_bonus,
    }
    valid = True
    for key, points in [*bounded.items(), ("tierSpan", serial.tier_span)]:
        if not 0 <= points <= BAND_STEP - 1:
            issues.error(
                f"{SERIAL_SETTINGS}.{key}",
                f"{points} is out of range; expected an integer 0..{BAND_STEP - 1} "
                "(bounded terms never cross a priority band)",
            )
            valid = False
    error = band_lift_error(bounded, serial.tier_span) if valid else None
    if error is not None:
        issues.error(SERIAL_SETTINGS, error)


def aging_divisor(issues: Issues, value: float) -> tuple[float, int]:
    """`agingDivisor` in seconds, and exactly in integer nanoseconds."""
    where = f"{SERIAL_SETTINGS}.agingDivisor"
    allowed = f"a number >= 0 (0 disables aging) with at most {MAX_AGING_DECIMALS} decimal places"
    if not math.isfinite(value) or value < 0:
        issues.error(where, f"{value!r} is out of range; expected {allowed}")
        return DEFAULT_AGING_DIVISOR, DEFAULT_AGING_DIVISOR_NS
    # repr is the shortest text that round-trips, i.e. what the user wrote.
    exact = Decimal(repr(value))
    exponent = exact.as_tuple().exponent
    if isinstance(exponent, int) and exponent < -MAX_AGING_DECIMALS:
        issues.error(
            where,
            f"{value!r} has too many decimal places; expected {allowed} "
            "so it converts exactly to integer nanoseconds",
        )
        return DEFAULT_AGING_DIVISOR, DEFAULT_AGING_DIVISOR_NS
    return value, int(exact * 10**9)
