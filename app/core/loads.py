"""What a load does to the other models: the answers the run loop asks before
it loads, stops or preloads anything, so every such choice is the core's.

A dispatch that swaps names what it evicts (`policy.Choice.evicted`); a load
that no dispatch asked for (a preload, a reload after a crash or a TTL stop
that raced a release) asks `idle_evictions` or `preload_evictions`, which
never take a busy model away. `plan_load` says which processes the load stops
and which stops it waits for before its own process starts, so two models of
one lane are never up at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Set

import msgspec

from app.core.residency import MemoryRouter, Router, to_evict
from app.core.state import SchedulerState


class LoadPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What the run loop does for one load, in this order."""

    stop: tuple[str, ...]
    """The models whose processes it stops now (evicted for it), in this order."""
    wait_for: tuple[str, ...]
    """The stops (those it starts and any already in progress) that must end
    before its own process starts, sorted."""


def idle_evictions(state: SchedulerState, model: str) -> frozenset[str]:
    """What a load of `model` that no dispatch planned evicts: the models the
    router says it evicts, less the busy ones (a reload after a crash leaves
    busy models alone)."""
    return frozenset(m for m in state.to_evict(model, state.occupied()) if not state.busy(m))


def preload_evictions(state: SchedulerState, model: str) -> frozenset[str] | None:
    """What a preload of `model` evicts, or None when it may not load now: it is
    in use (loaded or loading) already, or loading it would evict a busy model."""
    if model in state.in_use:
        return None
    evict = state.to_evict(model, state.occupied())
    if any(state.busy(m) for m in evict):
        return None
    return evict


def plan_load(
    router: Router | None,
    model: str,
    evicted: Iterable[str],
    processes: Iterable[str],
    stopping: Set[str],
) -> LoadPlan:
    """The stops a load of `model` makes and waits for. `evicted`: what it
    evicts (sorted); `processes`: the models with a process, in the order they
    were spawned; `stopping`: the models whose stop is in progress.

    With no router (one model at a time) it stops every other process and waits
    for every stop. With a router it stops what it evicts, and waits for those,
    for any stop in progress the router would have had it evict (its lane), and
    for a stop of its own model's previous process."""
    evicted = list(evicted)
    live = list(processes)
    if router is None:
        stop = [other for other in live if other != model]
    else:
        stop = [other for other in evicted if other in live]
    after = set(stopping) | set(stop)
    if router is None or isinstance(router, MemoryRouter):
        # Memory: every stop in progress still holds GPU memory the load may need.
        wait_for = after
    else:
        wait_for = set(to_evict(router, model, frozenset(after))) | (after & {model, *evicted})
    return LoadPlan(stop=tuple(stop), wait_for=tuple(sorted(wait_for)))
