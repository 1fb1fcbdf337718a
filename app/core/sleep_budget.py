"""Which sleeping servers to stop so that one more may sleep: the host-memory
budget for sleepers (`sleepHostMemory`), a pure answer the run loop asks before
it puts a model to sleep.

Each sleeper counts the host memory it declared (`sleep.hostMemory`; a sleeper
that declares none counts 0). A model that alone needs more than the budget is
stopped instead of put to sleep; otherwise the sleepers asleep longest are
stopped first until it fits (the least recently used: the one least likely to
be asked for next).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec


class Sleeper(msgspec.Struct, frozen=True):
    model: str
    host_memory: int
    since_ns: int
    """When it fell asleep."""


class SleepRoom(msgspec.Struct, frozen=True):
    sleep: bool
    """False: stop the candidate instead (it alone does not fit)."""
    stop: tuple[str, ...] = ()
    """Sleepers to stop first, longest asleep first."""


def make_room(candidate: int, sleepers: Iterable[Sleeper], budget: int | None) -> SleepRoom:
    """Whether a server holding `candidate` bytes asleep may sleep under `budget`
    (None: no bound), and which `sleepers` to stop first so that it fits."""
    if budget is None:
        return SleepRoom(sleep=True)
    if candidate > budget:
        return SleepRoom(sleep=False)
    asleep = sorted(sleepers, key=lambda s: (s.since_ns, s.model))
    used = sum(s.host_memory for s in asleep)
    stop: list[str] = []
    for sleeper in asleep:
        if used + candidate <= budget:
            break
        stop.append(sleeper.model)
        used -= sleeper.host_memory
    return SleepRoom(sleep=True, stop=tuple(stop))


def describe(size: int) -> str:
    """`size` bytes in GiB or MiB, for a sentence."""
    if size >= 1 << 30:
        return f"{size / (1 << 30):.1f} GiB"
    return f"{size / (1 << 20):.0f} MiB"
