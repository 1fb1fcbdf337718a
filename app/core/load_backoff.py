"""Back-off between the load attempts of a model that fails to load.

A model whose load fails is not loaded again at once: its waiting requests wait
`delay_ns(n)` after its `n`-th consecutive failure (`first_ns`, doubling, at
most `max_ns`), while other models' requests are served. After
`failure_limit` consecutive failures its waiting requests fail with the
loader's error (`app.core.policy.given_up`). A finished load ends the series.

The settings are recorded in `server_started` (absent in older logs: all 0, no
back-off and no limit, which is how those logs were decided), and the failures
are folded from `swap_failed` (`app.core.state`), so `replay --verify`
reproduces every decision a back-off delayed.
"""

from __future__ import annotations

import msgspec


class LoadBackoff(msgspec.Struct, frozen=True):
    """`loadBackoff`, `loadBackoffMax` and `loadFailureLimit`, as `server_started`
    recorded them."""

    first_ns: int = 0
    """The wait after a first failure (0: no back-off)."""
    max_ns: int = 0
    """The longest wait between two attempts."""
    failure_limit: int = 0
    """Consecutive failures after which the waiting requests fail (0: never)."""

    def delay_ns(self, failures: int) -> int:
        """How long after its `failures`-th consecutive failure a model may load again."""
        if failures <= 0 or self.first_ns <= 0:
            return 0
        # Doubling stops at the cap (and before the shift grows without bound).
        delay = self.first_ns
        for _ in range(failures - 1):
            if delay >= self.max_ns:
                break
            delay *= 2
        return min(delay, max(self.max_ns, self.first_ns))


NO_BACKOFF = LoadBackoff()


class LoadFailures(msgspec.Struct):
    """A model's consecutive failed loads (reset when one finishes)."""

    count: int
    last_ns: int
    """When the last one failed (its `swap_failed.at`)."""
    error: str
    """The loader's error of the last one."""
