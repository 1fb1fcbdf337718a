"""Which models may be resident together: llama-swap's routers as pure functions.

A router answers one question, as llama-swap's `Swapper` does
(`internal/router/group.go`, `matrix_solver.go`): to load `target` while the
models in `resident` are loaded, which of them must be stopped? `to_evict` is
that function. It knows nothing of queues, slots or processes: whether an
eviction can happen now (the model is idle) is the scheduler's question.

- No router (`None`): every model is in one implicit group (`swap: true,
  exclusive: true`), so loading a model evicts every other one. This is the
  single lane: one model at a time.
- `GroupRouter` (`routing.router.use: group`): a `swap: true` group holds one
  member at a time; loading a member of an `exclusive: true` group evicts the
  models of every other group that is not `persistent: true`. Loading a member
  of a non-exclusive group evicts nothing outside its own group, even a
  resident exclusive group (llama-swap keeps that gotcha of its old
  ProcessGroup; the matrix has no such case).
- `MatrixRouter` (`routing.router.use: matrix`): every set lists models that
  may be resident together (a subset of a set is allowed too). The solver keeps
  the set that contains the target and costs least to reach: the sum of the
  `evict_costs` of the resident models it leaves out (1 each unless
  configured); equal costs go to the earlier set. A model in no set runs alone.

- `MemoryRouter` (`routing.router.use: memory`, gpulane's own): models stay
  resident together while the sum of their footprints fits the budget; a load
  that does not fit evicts by one rule (`memory_evictions`). A model of unknown
  size loads alone, so its size gets measured. A model whose server ran out of
  GPU memory (`RanOut`: the `out_of_memory` of its `swap_failed` or
  `process_stopped`) counts as of unknown size until a load of it succeeds and
  measures it: its next load makes room as if it needed the whole budget
  (every idle co-resident model goes first; it waits for a busy one), and a
  size only declared, shown too small, is not trusted again (a reload that
  declares another one is).

llama-swap's routers never refuse a load: a persistent group is simply left
resident beside the target. So `to_evict` always returns a set, and a target
that cannot load *now* is one whose evictions are not idle, which is for the
caller to judge.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from functools import cached_property
from typing import Final

import msgspec

DEFAULT_GROUP: Final = "(default)"
"""The group llama-swap puts every model that no configured group names into."""
DEFAULT_EVICT_COST: Final = 1
"""A matrix model's eviction cost when `evict_costs` does not name it."""


class Group(msgspec.Struct, frozen=True, kw_only=True):
    """One group of `routing.router.settings.groups`, its members resolved to model ids."""

    name: str
    members: tuple[str, ...]
    swap: bool = True
    """One member resident at a time: loading one evicts its resident siblings."""
    exclusive: bool = True
    """Loading a member evicts every other non-persistent group's models."""
    persistent: bool = False
    """Never evicted by another group's model (its own swap still applies)."""


class GroupRouter(msgspec.Struct, frozen=True, kw_only=True, tag="group", dict=True):
    """`routing.router.use: group`. Every configured model is in exactly one group
    (the ones no group names are in `DEFAULT_GROUP`)."""

    groups: tuple[Group, ...]

    def group_of(self, model: str) -> Group | None:
        return self._homes.get(model)

    @cached_property
    def _homes(self) -> dict[str, Group]:
        """Model -> the first group that names it, built once per router (the
        router is frozen; `dict=True` gives it a place for this, never encoded)."""
        homes: dict[str, Group] = {}
        for group in self.groups:
            for model in group.members:
                homes.setdefault(model, group)
        return homes

    @cached_property
    def _evict_memo(self) -> dict[tuple[str, frozenset[str]], frozenset[str]]:
        """`to_evict`'s answers for this router, by (target, resident)."""
        return {}


class MatrixSet(msgspec.Struct, frozen=True, kw_only=True):
    """One model set a matrix expression allows: `a & (b | c)` is two of them."""

    name: str
    """The `sets` entry it comes from."""
    models: frozenset[str]


class MatrixRouter(msgspec.Struct, frozen=True, kw_only=True, tag="matrix", dict=True):
    """`routing.router.use: matrix`, its expressions expanded to model sets."""

    sets: tuple[MatrixSet, ...]
    """In llama-swap's order, which breaks ties: entries in definition order,
    except that a set referenced with `+name` comes before the sets that use it;
    within an entry, the order of its expression."""
    evict_costs: dict[str, int] = {}
    """Model id -> cost of evicting it (>= 1); unnamed models cost `DEFAULT_EVICT_COST`."""

    @cached_property
    def _evict_memo(self) -> dict[tuple[str, frozenset[str]], frozenset[str]]:
        """`to_evict`'s answers for this router, by (target, resident)."""
        return {}

    def cost(self, model: str) -> int:
        return self.evict_costs.get(model, DEFAULT_EVICT_COST)

    def best_set(self, target: str, resident: Set[str]) -> tuple[MatrixSet, int] | None:
        """The cheapest set containing `target`, and what reaching it costs; None when
        no set contains it."""
        best: tuple[MatrixSet, int] | None = None
        for candidate in self.sets:
            if target not in candidate.models:
                continue
            cost = sum(self.cost(m) for m in resident if m not in candidate.models)
            if best is None or cost < best[1]:
                best = (candidate, cost)
                if cost == 0:
                    break
        return best


class MemoryRouter(msgspec.Struct, frozen=True, kw_only=True, tag="memory", dict=True):
    """`routing.router.use: memory`: models share the GPU while their footprints fit."""

    budget_mib: int
    """The GPU memory models may take together (`budget`; `auto`: the GPU's
    total less `reserve`, read when the config was)."""
    declared_mib: dict[str, int] = {}
    """Each model's `gpuMemory`: its footprint until one is measured."""
    measured_mib: dict[str, int] = {}
    """At a `server_started`: each model's footprint last measured in the log
    before it (a measurement in this process replaces it)."""
    load_ns: dict[str, int] = {}
    """At a `server_started`: each model's load time learnt from the log before
    it (the median of its last loads), what evicting it costs; a load in this
    process replaces it."""
    side_by_side: bool = False
    """False (the default): co-resident models share one lane, one job at a time
    on the GPU. True: each runs its own slots beside the others."""

    def footprint(self, model: str, measured: Mapping[str, int]) -> int | None:
        """What `model` takes (MiB): measured in this process (`measured`), else
        before it, else declared; None: unknown."""
        found = measured.get(model)
        if found is None:
            found = self.measured_mib.get(model)
        return self.declared_mib.get(model) if found is None else found


class RanOut(msgspec.Struct, frozen=True, kw_only=True):
    """A model whose server last ran out of GPU memory (the `out_of_memory` of its
    `swap_failed` or `process_stopped`), until a load of it succeeds and measures
    it (`SchedulerState.ran_out`): the memory router takes it as of unknown
    size, so its next load evicts every idle co-resident model first."""

    beside: list[str] = []
    """The models resident or loading beside it then (sorted; none: it ran out alone)."""
    loading: bool = True
    """At a load (its start failed); False: while it ran (its server died)."""

    def why(self, model: str, evicted: Iterable[str]) -> str:
        """Why a load of `model` evicted `evicted`, for explain: `B ran out of GPU
        memory at its last load beside A: A was put away first`."""
        when = "at its last load" if self.loading else "while it ran"
        beside = f" beside {_and(self.beside)}" if self.beside else ""
        gone = list(evicted)
        verb = "was" if len(gone) == 1 else "were"
        return f"{model} ran out of GPU memory {when}{beside}: {_and(gone)} {verb} put away first"


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


class MemoryView(msgspec.Struct, frozen=True, kw_only=True):
    """What the memory router weighs besides sizes, as plain values: the
    scheduler state fills it (`SchedulerState.memory_view`), so the rule stays
    a pure function."""

    measured_mib: Mapping[str, int] = {}
    """Footprints measured in this process (they replace the router's)."""
    costs_ns: Mapping[str, int] = {}
    """What bringing each model back costs: its load time (a model absent costs 0)."""
    last_used_ns: Mapping[str, int] = {}
    """When each model last finished a request or a load."""
    needed: Set[str] = frozenset()
    """Models a waiting request needs."""
    busy: Set[str] = frozenset()
    """Models running requests or loading: they cannot go now."""
    others_mib: int = 0
    """GPU memory processes gpulane does not own hold (`gpu_memory_seen`): it
    is taken off the budget."""
    ran_out: Set[str] = frozenset()
    """Models whose server last ran out of GPU memory (`RanOut`): of unknown size."""


Router = GroupRouter | MatrixRouter | MemoryRouter

_NO_VIEW: Final = MemoryView()


def memory_evictions(
    router: MemoryRouter, target: str, resident: Set[str], view: MemoryView = _NO_VIEW
) -> frozenset[str]:
    """What loading `target` beside `resident` evicts under the memory router.

    `target` loads beside the resident models while the sum of the footprints
    fits `budget_mib`, less what other processes hold (`view.others_mib`). A
    model of unknown size (nothing measured, nothing declared, or its server ran
    out of GPU memory since it was last measured: `view.ran_out`) loads alone,
    and a resident one of unknown size makes room for any load; so does every
    model when the target alone does not fit. Otherwise the resident models are taken
    in this order until the target fits: idle before busy (a busy one cannot go
    now), then never one a waiting request needs if another choice makes room,
    then the cheapest to bring back (`costs_ns`), then the least recently used,
    then by name; last, any taken that the others made unneeded is kept again
    (latest taken first)."""
    others = sorted(m for m in resident if m != target)
    if target in resident or not others:
        return frozenset()
    if target in view.ran_out:
        return frozenset(others)  # of unknown size: it loads alone
    budget = router.budget_mib - view.others_mib
    size = router.footprint(target, view.measured_mib)
    if size is None or size > budget:
        return frozenset(others)
    sizes = {m: router.footprint(m, view.measured_mib) for m in others}
    for model in view.ran_out:
        if model in sizes:
            sizes[model] = None
    evict = [m for m in others if sizes[m] is None]
    known = {m: mib for m, mib in sizes.items() if mib is not None}
    free = budget - size - sum(known.values())
    if free >= 0:
        return frozenset(evict)
    order = sorted(
        known,
        key=lambda m: (
            m in view.busy,
            m in view.needed,
            view.costs_ns.get(m, 0),
            view.last_used_ns.get(m, 0),
            m,
        ),
    )
    taken: list[str] = []
    for model in order:
        taken.append(model)
        free += known[model]
        if free >= 0:
            break
    for model in reversed(taken[:-1]):  # the last one taken made the room
        if free - known[model] >= 0:
            free -= known[model]
            taken.remove(model)
    return frozenset(evict + taken)


def to_evict(
    router: Router | None, target: str, resident: Set[str], view: MemoryView | None = None
) -> frozenset[str]:
    """The resident models that must stop for `target` to be loaded (never `target`).
    `view`: what the memory router weighs besides sizes (other routers ignore it;
    without it, the memory router weighs sizes alone).

    Raises ValueError when a group router has no group for `target`: every
    configured model has one, so that is a caller's mistake.
    """
    if router is None:
        return frozenset(resident) - {target}
    if isinstance(router, MemoryRouter):
        return memory_evictions(router, target, resident, view or _NO_VIEW)
    if not isinstance(resident, frozenset):
        return _evictions(router, target, resident)
    # A pure function of frozen values: remembered per router, since a dispatch
    # asks it for each model it walks and the resident sets are few.
    memo = router._evict_memo
    key = (target, resident)
    evict = memo.get(key)
    if evict is None:
        if len(memo) >= _EVICT_MEMO:
            memo.clear()
        evict = memo[key] = _evictions(router, target, resident)
    return evict


_EVICT_MEMO: Final = 1024
"""Entries a router's `to_evict` memo holds before it starts again."""


def _evictions(
    router: GroupRouter | MatrixRouter, target: str, resident: Set[str]
) -> frozenset[str]:
    if isinstance(router, GroupRouter):
        return _group_evictions(router, target, resident)
    return _matrix_evictions(router, target, resident)


def _group_evictions(router: GroupRouter, target: str, resident: Set[str]) -> frozenset[str]:
    homes = router._homes
    home = homes.get(target)
    if home is None:
        raise ValueError(f"model {target!r} is in no group of the router")
    evict: set[str] = set()
    for model in resident:
        if model == target:
            continue
        group = homes.get(model)
        if group is home:
            if home.swap:
                evict.add(model)
        elif home.exclusive and (group is None or not group.persistent):
            # A resident model of no group (e.g. one dropped by a config
            # reload) is treated as non-persistent, as llama-swap does.
            evict.add(model)
    return frozenset(evict)


def _matrix_evictions(router: MatrixRouter, target: str, resident: Set[str]) -> frozenset[str]:
    if target in resident:
        return frozenset()
    best = router.best_set(target, resident)
    if best is None:
        return frozenset(resident)  # in no set: it runs alone
    return frozenset(resident) - best[0].models


def one_at_a_time(router: Router | None, models: Iterable[str]) -> bool:
    """Whether the router lets at most one of `models` be resident at a time:
    loading any of them evicts every other one, as with no router (one implicit
    group). A run on such a router decides as the single lane does."""
    if isinstance(router, MemoryRouter):
        return False  # sizes measured later may let them share: never assumed
    every = frozenset(models)
    return all(to_evict(router, m, every - {m}) == every - {m} for m in every)


def can_coexist(router: Router | None, models: Iterable[str]) -> bool:
    """Whether `models`, loaded one after another in this order from nothing,
    all stay resident. (Order matters to groups only: an exclusive group's model
    evicts a non-exclusive one loaded before it, not one loaded after it.)"""
    resident: set[str] = set()
    for model in models:
        if to_evict(router, model, resident):
            return False
        resident.add(model)
    return True


class Skipped(msgspec.Struct, frozen=True, kw_only=True):
    """A model the preload does not keep: one listed after it evicts it."""

    model: str
    evicted_by: str

    def why(self, router: Router | None) -> str:
        """The warning `check-config` and the start-up log give."""
        return (
            f"{self.model!r} is not kept preloaded: with {describe(router)}, "
            f"{self.evicted_by!r}, listed after it, evicts it (models are preloaded "
            "in turn, as llama-swap does: the last of those that cannot be resident "
            "together stays)"
        )


class PreloadPlan(msgspec.Struct, frozen=True, kw_only=True):
    load: tuple[str, ...]
    """The models to load; all resident together at the end."""
    skipped: tuple[Skipped, ...] = ()


def plan_preload(router: Router | None, models: Iterable[str]) -> PreloadPlan:
    """`hooks.on_startup.preload`: what loading each model in turn, as llama-swap
    does, leaves resident, without loading the ones a later one would evict at
    once. Each load evicts what the router says among those loaded before it, so
    of several that cannot be resident together the last stays; the others are
    reported, each with the model that evicts it. A model loaded already is not
    loaded again."""
    load: list[str] = []
    evicted_by: dict[str, str] = {}
    for model in models:
        if model in load:
            continue
        evicted = to_evict(router, model, frozenset(load))
        for gone in sorted(evicted):
            evicted_by[gone] = model
        evicted_by.pop(model, None)
        load = [m for m in load if m not in evicted] + [model]
    skipped = tuple(
        Skipped(model=m, evicted_by=by) for m, by in evicted_by.items() if m not in load
    )
    return PreloadPlan(load=tuple(load), skipped=skipped)


def describe(router: Router | None) -> str:
    """One line naming the router, for warnings and logs."""
    if router is None:
        return "no router (one model at a time)"
    if isinstance(router, GroupRouter):
        names = ", ".join(g.name for g in router.groups)
        return f"group router ({len(router.groups)} groups: {names})"
    if isinstance(router, MemoryRouter):
        lane = "side by side" if router.side_by_side else "one lane"
        return f"memory router (budget {router.budget_mib} MiB, {lane})"
    names = ", ".join(dict.fromkeys(s.name for s in router.sets))
    count = len(router.sets)
    return f"matrix router ({count} model set{'' if count == 1 else 's'} from: {names})"
