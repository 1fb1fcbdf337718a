"""The score, in exact integer arithmetic.

    score = priority + affinity + fair_share + short_job + (now - enqueued_at) / agingDivisor

`now` is the same for every candidate at a decision, so ordering by score is
ordering by `priority + ... - enqueued_at / agingDivisor`. Multiplying through
by the divisor in nanoseconds gives integer keys: the part fixed at enqueue
(priority, aging, and short job in logs before format 3) is a heap key;
affinity, fair share and (format 3 on) short job depend on the state at the
decision and are added to a heap's top, per model, endpoint and caller
(`app.core.queue`). No floating-point ties to break replay.

- short_job = shortJobBonus x R / (R + expected run), R = 60 s: a 6 s chat gets
  0.91 of the bonus, a 4 min render 0.2, no history 0. From log format 3 the
  expected run is one current estimate per (model, endpoint), so identical
  requests never differ in it (`ScoreQueue.expected`).
- fair_share = fairShareBonus x (most - mine) / (most - least) over the attained
  service of the callers with open work (`SchedulerState.fair_keys`): the least
  served caller gets the whole bonus, the most served none (all none when equal).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, TypeVar

import msgspec

NS_PER_S: Final = 1_000_000_000
# The defaults of agingDivisor and swapAffinityBonus; the config reads them here.
DEFAULT_AGING_DIVISOR_NS: Final = 60 * NS_PER_S
DEFAULT_SWAP_AFFINITY_BONUS: Final = 10
SHORT_JOB_REFERENCE_NS: Final = 60 * NS_PER_S
"""The expected run time that earns half the short-job bonus."""

_K = TypeVar("_K")


class ScoringParams(msgspec.Struct, frozen=True):
    """The tunable terms. `aging_divisor_ns` 0 disables aging."""

    aging_divisor_ns: int = DEFAULT_AGING_DIVISOR_NS
    swap_affinity_bonus: int = DEFAULT_SWAP_AFFINITY_BONUS
    fair_share_bonus: int = 0
    short_job_bonus: int = 0

    @property
    def scale(self) -> int:
        """Multiplier that turns score points into key units."""
        return self.aging_divisor_ns or 1

    def base_key(self, priority: int, enqueued_ns: int, expected_run_ns: int | None = None) -> int:
        """The part of the score fixed at enqueue (priority, short job, aging), times
        the divisor, minus the common `now` term."""
        key = priority * self.scale + self.short_job_key(expected_run_ns)
        return key if self.aging_divisor_ns == 0 else key - enqueued_ns

    def plain_key(self, priority: int, expected_run_ns: int | None = None) -> int:
        """`base_key` without aging: who would win with agingDivisor 0."""
        return priority * self.scale + self.short_job_key(expected_run_ns)

    def affinity_key(self) -> int:
        """What the swap-affinity bonus adds to a key."""
        return self.swap_affinity_bonus * self.scale

    def short_job_key(self, expected_run_ns: int | None) -> int:
        """The short-job term in key units (floor): 0 when off or without history."""
        if self.short_job_bonus == 0 or expected_run_ns is None:
            return 0
        ref = SHORT_JOB_REFERENCE_NS
        return self.short_job_bonus * self.scale * ref // (ref + max(0, expected_run_ns))

    def fair_share_keys(self, served: Mapping[_K, int]) -> dict[_K, int]:
        """The fair-share term in key units (floor) of each active caller, from
        its attained service (`served`) against the least and most served."""
        if self.fair_share_bonus == 0 or not served:
            return {}
        least, most = min(served.values()), max(served.values())
        if most <= least:
            return dict.fromkeys(served, 0)  # nobody has had less: nobody is favoured
        full, span = self.fair_share_bonus * self.scale, most - least
        return {caller: full * (most - mine) // span for caller, mine in served.items()}

    def breakdown(
        self,
        priority: int,
        enqueued_ns: int,
        now_ns: int,
        resident: bool,
        *,
        expected_run_ns: int | None = None,
        fair_key: int = 0,
    ) -> Breakdown:
        """The score's terms at `now_ns`, for reports (floats are for people, not
        ordering). `fair_key`: the caller's fair-share term in key units."""
        affinity = self.swap_affinity_bonus if resident else 0
        if self.aging_divisor_ns == 0:
            aging = 0.0
        else:
            aging = max(0, now_ns - enqueued_ns) / self.aging_divisor_ns
        fair = fair_key / self.scale
        short = self.short_job_key(expected_run_ns) / self.scale
        return Breakdown(
            priority=priority,
            affinity=affinity,
            aging=aging,
            total=priority + affinity + aging + fair + short,
            fair_share=fair,
            short_job=short,
        )


class Breakdown(msgspec.Struct, frozen=True, omit_defaults=True):
    """One candidate's score split into its terms (terms that are off are not
    written, so logs from before they existed round-trip unchanged)."""

    priority: int
    affinity: int
    aging: float
    total: float
    fair_share: float = 0.0
    short_job: float = 0.0
