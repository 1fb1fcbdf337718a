"""What a waiting request waits for, in the machine's terms: a free slot of its
model, a model to drain, or a load.

One answer for every reader (`/api/queue` and `gpulane queue`, `explain`'s wait
parts): a pure function of the folded state, read off the same facts the
dispatch rule weighs (app/core/policy.py, docs/scheduling.md "Slots and the
dispatch rule"):

- its model is being loaded: it waits for that **load** (a preload, or a load
  whose slots are taken by the requests that joined it);
- its model is resident and every slot is taken: it waits for a **free slot**;
- its model is resident with a free slot, but a higher request's load must evict
  it: the model **drains** for that request (it takes no new work);
- its model is not in use and its load evicts models with work in flight: those
  models **drain** (for the best waiting request of its model);
- otherwise it waits for the **load** of its model (behind higher requests that
  start first), or, in the moment between two decisions, for its turn.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from app.core.state import SchedulerState

Kind = Literal["slot", "drain", "load", "turn"]


class WaitsFor(msgspec.Struct, frozen=True):
    """What a waiting request waits for (see the module's docstring)."""

    kind: Kind
    model: str
    """slot: its model; drain: the model draining; load: the model to load."""
    for_request: str | None = None
    """drain: the request whose load the model drains for."""
    for_caller: str | None = None
    """Its caller."""
    another_caller: bool = False
    """Shown to a user key when `for_request` is another caller's: its id and caller
    are then None (app/report/visibility.py)."""
    for_itself: bool = False
    """On the row of the request the model drains for (`for_request` is then None):
    its own load waits for the drain (`for_row`)."""

    def for_row(self, request_id: str) -> WaitsFor:
        """As the row of `request_id` shows it: a drain for that request itself is
        a drain for its own load, not for its id."""
        if self.for_request != request_id:
            return self
        return msgspec.structs.replace(self, for_request=None, for_caller=None, for_itself=True)

    def text(self) -> str:
        """`a free slot of A`, `A to drain for r12`, `A to drain for its own load`,
        `the load of B`."""
        if self.kind == "slot":
            return f"a free slot of {self.model}"
        if self.kind == "drain":
            who = self.for_request or (
                "another caller's request"
                if self.another_caller
                else "its own load"
                if self.for_itself
                else ""
            )
            return f"{self.model} to drain" + (f" for {who}" if who else "")
        if self.kind == "load":
            return f"the load of {self.model}"
        return "its turn"


def waits_for(state: SchedulerState, model: str) -> WaitsFor:
    """What a waiting request for `model` waits for in `state` (see above)."""
    if model in state.loads:
        return WaitsFor("load", model)
    occupied = state.occupied()
    if model in state.in_use:
        if state.running_on(model) >= state.slots(model):
            return WaitsFor("slot", model)
        higher = _draining_for(state, model, occupied)
        return WaitsFor("turn", model) if higher is None else higher
    if state.running_on(model):
        return WaitsFor("drain", model)  # stopped under running work: it ends first
    evicted = state.to_evict(model, occupied)
    busy = sorted(m for m in evicted if state.busy(m))
    if busy:
        return _drain(state, busy[0], model)
    return WaitsFor("load", model)


def _draining_for(state: SchedulerState, model: str, occupied: frozenset[str]) -> WaitsFor | None:
    """A resident `model` held for a higher request's load that evicts it."""
    for target in state.queue.model_order(state.in_use, state.fair_keys()):
        if target == model:
            return None  # nothing above it evicts it
        if target in state.in_use:
            continue
        if model in state.to_evict(target, occupied):
            return _drain(state, model, target)
    return None


def _drain(state: SchedulerState, model: str, target: str) -> WaitsFor:
    """`model` drains for the best waiting request of `target`."""
    others = frozenset(state.queue.models()) - {target}
    best = state.queue.best(state.in_use, state.fair_keys(), skip=others)
    if best is None:
        return WaitsFor("drain", model)
    return WaitsFor("drain", model, best.request_id, best.caller)
