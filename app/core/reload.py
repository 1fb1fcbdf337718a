"""What a config reload does to the models and the queue: the run loop asks
this before it records a `config_reloaded`, so each choice is the core's.

A model is known by what its process is made of (its command, stop command,
address, environment, readiness check and peer: `Process` below). At a reload:
- a model that is gone fails its waiting requests (they asked for something
  that no longer exists) and finishes its running ones; its process then stops
  once idle;
- a model whose process would differ is restarted once idle, never mid-request,
  so its next load runs the new command;
- every other request keeps its place, and new models serve at once.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping

import msgspec

from app.core.state import SchedulerState


class ReloadPlan(msgspec.Struct, frozen=True, kw_only=True):
    added: list[str]
    removed: list[str]
    restarted: list[str]
    """Models with a process (or a load) to stop once idle: removed or changed, sorted."""
    failed: list[str]
    """Waiting requests of removed models, in arrival order: they fail."""


def plan_reload(
    state: SchedulerState,
    old: Mapping[str, Hashable],
    new: Mapping[str, Hashable],
    with_process: Iterable[str],
) -> ReloadPlan:
    """`old`, `new`: each model's process identity before and after;
    `with_process`: the models that have a process now."""
    removed = sorted(m for m in old if m not in new)
    restarted = sorted(
        m for m in set(with_process) | set(state.in_use) if m not in new or old.get(m) != new[m]
    )
    failed = [rid for rid, r in state.requests.items() if not r.running and r.model not in new]
    return ReloadPlan(
        added=sorted(m for m in new if m not in old),
        removed=removed,
        restarted=restarted,
        failed=failed,
    )
