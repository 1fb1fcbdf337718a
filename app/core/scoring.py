"""The score: priority + swap affinity + aging, in exact integer arithmetic.

    score = priority + affinity + (now - enqueued_at) / agingDivisor

`now` is the same for every candidate at a decision, so ordering by score is
ordering by `priority + affinity - enqueued_at / agingDivisor`. Multiplying
through by the divisor in nanoseconds gives an integer key fixed at enqueue:
no re-sorting as time passes and no floating-point ties to break replay.
"""

from __future__ import annotations

from typing import Final

import msgspec

NS_PER_S: Final = 1_000_000_000
# The defaults of agingDivisor and swapAffinityBonus; the config reads them here.
DEFAULT_AGING_DIVISOR_NS: Final = 60 * NS_PER_S
DEFAULT_SWAP_AFFINITY_BONUS: Final = 10


class ScoringParams(msgspec.Struct, frozen=True):
    """The tunable terms. `aging_divisor_ns` 0 disables aging."""

    aging_divisor_ns: int = DEFAULT_AGING_DIVISOR_NS
    swap_affinity_bonus: int = DEFAULT_SWAP_AFFINITY_BONUS

    @property
    def scale(self) -> int:
        """Multiplier that turns score points into key units."""
        return self.aging_divisor_ns or 1

    def base_key(self, priority: int, enqueued_ns: int) -> int:
        """Score without affinity, times the divisor, minus the common `now` term."""
        if self.aging_divisor_ns == 0:
            return priority
        return priority * self.aging_divisor_ns - enqueued_ns

    def affinity_key(self) -> int:
        """What the swap-affinity bonus adds to a key."""
        return self.swap_affinity_bonus * self.scale

    def breakdown(self, priority: int, enqueued_ns: int, now_ns: int, resident: bool) -> Breakdown:
        """The score's terms at `now_ns`, for reports (floats are for people, not ordering)."""
        affinity = self.swap_affinity_bonus if resident else 0
        if self.aging_divisor_ns == 0:
            aging = 0.0
        else:
            aging = max(0, now_ns - enqueued_ns) / self.aging_divisor_ns
        return Breakdown(
            priority=priority, affinity=affinity, aging=aging, total=priority + affinity + aging
        )


class Breakdown(msgspec.Struct, frozen=True):
    """One candidate's score split into its terms."""

    priority: int
    affinity: int
    aging: float
    total: float
