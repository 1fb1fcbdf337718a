"""Sizes of GPU memory in the config (`gpuMemory: 24GiB`, `budget: 80GiB`),
read strictly: a number and a unit, into MiB."""

from __future__ import annotations

import re
from typing import Final

from app.config.checks import Issues

_UNITS: Final = {
    "mib": 1.0,
    "gib": 1024.0,
    "tib": 1024.0 * 1024,
    "mb": 1e6 / 2**20,
    "gb": 1e9 / 2**20,
    "tb": 1e12 / 2**20,
}
_SIZE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*$")
ALLOWED: Final = "a size with a unit: MiB, GiB, TiB, MB, GB or TB (e.g. 24GiB)"


def parse_mib(issues: Issues, value: object, where: str) -> int | None:
    """`value` in MiB (rounded up), or None after an error naming `where`."""
    match = _SIZE.match(value) if isinstance(value, str) else None
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        issues.error(where, f"{value!r} is not allowed; expected {ALLOWED}")
        return None
    mib = -(-float(match.group(1)) * unit // 1)  # ceil: a size never shrinks
    if mib < 1:
        issues.error(where, f"{value!r} is out of range; expected at least 1MiB")
        return None
    return int(mib)
