"""Resolving llama-swap's router settings into the core's `Router`.

`routing.router` (`use: group | matrix`, `settings.groups`, `settings.matrix`)
and the older top-level `groups` / `matrix` become a `GroupRouter`, a
`MatrixRouter` or None (no router: one model at a time); gpulane's own
`use: memory` (`settings.memory`) a `MemoryRouter`. The checks follow
llama-swap's loader: the two spellings may not be mixed, a model is in at most
one group, models no group names form the group `(default)`, matrix names are
vars or model ids, and eviction costs are positive.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from typing import Final

from app.config.checks import Issues, join_path
from app.config.matrix import expand_sets
from app.config.memory_size import parse_mib
from app.config.raw import RawConfig, RawGroup, RawMatrix, RawMemoryRouter
from app.core.residency import (
    DEFAULT_GROUP,
    Group,
    GroupRouter,
    MatrixRouter,
    MatrixSet,
    MemoryRouter,
    Router,
)

GROUP: Final = "group"
MATRIX: Final = "matrix"
MEMORY: Final = "memory"
ROUTERS: Final = (GROUP, MATRIX, MEMORY)
DEFAULT_RESERVE_MIB: Final = 2048
"""With `budget: auto`, what the memory router leaves free of the GPU's total
(the CUDA context of each server, and room to breathe)."""
_VAR_KEY: Final = re.compile(r"^[a-zA-Z0-9.-]{1,32}$")  # llama-swap's rule


def resolve_router(
    raw: RawConfig,
    index: Mapping[str, str],
    issues: Issues,
    unknown: Callable[[str, str], str],
    *,
    declared_mib: Mapping[str, int] | None = None,
    gpu_total_mib: Callable[[], int | None] | None = None,
) -> Router | None:
    """The router the config describes, or None; problems go to `issues`.

    `index` maps model ids and aliases to ids; `unknown(name, outcome)` is the
    message for a name that is neither. The memory router takes each model's
    declared `gpuMemory` (`declared_mib`) and, for `budget: auto`, the GPU's
    total memory (`gpu_total_mib`: None when no telemetry can tell it).
    """
    router_raw = raw.routing.router
    settings = router_raw.settings
    legacy = raw.matrix is not None or bool(raw.groups)
    current = (
        bool(router_raw.use)
        or settings.matrix is not None
        or bool(settings.groups)
        or settings.memory is not None
    )
    if legacy and current:
        issues.error(
            "routing.router",
            "cannot be used together with the top-level `groups` / `matrix`; "
            "move them into routing.router.settings",
        )
        return None
    if legacy:
        if raw.matrix is not None and raw.groups:
            issues.error("matrix", "cannot be used together with `groups`; use one router")
            return None
        if raw.matrix is not None:
            router: Router | None = _matrix(raw.matrix, "matrix", index, issues, unknown)
        else:
            router = _groups(raw.groups, "groups", index, issues, unknown)
    else:
        use = router_raw.use or GROUP
        if use not in ROUTERS:
            issues.error(
                "routing.router.use",
                f"{use!r} is not allowed; expected one of {', '.join(ROUTERS)}",
            )
            return None
        base = "routing.router.settings"
        if use != MEMORY and settings.memory is not None:
            issues.warn(f"{base}.memory", f"not used: routing.router.use is {use}")
        if use == MEMORY:
            for other, given in (("groups", settings.groups), ("matrix", settings.matrix)):
                if given:
                    issues.warn(f"{base}.{other}", "not used: routing.router.use is memory")
            return _memory(
                settings.memory or RawMemoryRouter(),
                f"{base}.memory",
                issues,
                declared_mib or {},
                gpu_total_mib or _nvml_total_mib,
            )
        if use == MATRIX:
            if settings.matrix is None:
                issues.error(f"{base}.matrix", "required by routing.router.use: matrix")
                return None
            if settings.groups:
                issues.warn(f"{base}.groups", "not used: routing.router.use is matrix")
            router = _matrix(settings.matrix, f"{base}.matrix", index, issues, unknown)
        else:
            if settings.matrix is not None:
                issues.warn(f"{base}.matrix", "not used: routing.router.use is group")
            router = _groups(settings.groups, f"{base}.groups", index, issues, unknown)
    return router


def _memory(
    raw: RawMemoryRouter,
    base: str,
    issues: Issues,
    declared_mib: Mapping[str, int],
    gpu_total_mib: Callable[[], int | None],
) -> MemoryRouter | None:
    reserve = 0
    if raw.reserve is not None:
        if raw.budget != AUTO:
            issues.warn(f"{base}.reserve", "not used: the budget is a size, not auto")
        else:
            reserve = parse_mib(issues, raw.reserve, f"{base}.reserve") or 0
    elif raw.budget == AUTO:
        reserve = DEFAULT_RESERVE_MIB
    if raw.budget == AUTO:
        total = gpu_total_mib()
        if total is None:
            issues.error(
                f"{base}.budget",
                "'auto' needs GPU telemetry (NVML, an NVIDIA driver) and there is none "
                "here; give a size instead, e.g. budget: 80GiB",
            )
            return None
        budget: int | None = total - reserve
        if budget is not None and budget < 1:
            issues.error(
                f"{base}.reserve", f"leaves nothing of the GPU's {total} MiB; expected less"
            )
            return None
    else:
        budget = parse_mib(issues, raw.budget, f"{base}.budget")
    if budget is None:
        return None
    return MemoryRouter(
        budget_mib=budget,
        declared_mib=dict(sorted(declared_mib.items())),
        side_by_side=raw.side_by_side,
    )


AUTO: Final = "auto"


def _nvml_total_mib() -> int | None:
    """GPU 0's total memory (MiB) through NVML, None without a driver: what
    `budget: auto` is taken from when the config is read."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            total = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None
    return int(total) // (1024 * 1024)


def _groups(
    raw: Mapping[str, RawGroup],
    base: str,
    index: Mapping[str, str],
    issues: Issues,
    unknown: Callable[[str, str], str],
) -> GroupRouter | None:
    if not raw:
        return None
    owner: dict[str, str] = {}
    groups: list[Group] = []
    for name, group in raw.items():
        where = join_path(base, name)
        if name == DEFAULT_GROUP:
            issues.error(where, f"{name!r} is reserved for the models no group names")
            continue
        members: list[str] = []
        for i, given in enumerate(group.members):
            at = f"{where}.members[{i}]"
            model = index.get(given)
            if model is None:
                # llama-swap only checks members for duplicates, so its own
                # config.example.yaml names models it does not define.
                issues.warn(at, unknown(given, ", not a member"))
            elif model in members:
                issues.error(at, f"model {model!r} is listed twice in group {name!r}")
            elif model in owner:
                issues.error(
                    at,
                    f"model {model!r} is already in group {owner[model]!r}; "
                    "a model may be in one group only",
                )
            else:
                owner[model] = name
                members.append(model)
        groups.append(
            Group(
                name=name,
                members=tuple(members),
                swap=group.swap,
                exclusive=group.exclusive,
                persistent=group.persistent,
            )
        )
    rest = sorted(set(index.values()) - owner.keys())
    if rest:
        groups.append(Group(name=DEFAULT_GROUP, members=tuple(rest)))
    return GroupRouter(groups=tuple(groups))


def _matrix(
    raw: RawMatrix,
    base: str,
    index: Mapping[str, str],
    issues: Issues,
    unknown: Callable[[str, str], str],
) -> MatrixRouter | None:
    model_ids = set(index.values())
    errors = len(issues.errors)
    variables: dict[str, str] = {}
    for key, given in raw.vars.items():
        where = join_path(f"{base}.vars", key)
        if not _VAR_KEY.match(key):
            issues.error(where, "a var name is 1-32 letters, digits, `-` or `.`")
        model = index.get(given)
        if model is None:
            issues.error(where, unknown(given, ""))
        variables[key] = model if model is not None else given

    def resolve(name: str) -> str | None:
        if name in variables:
            return variables[name]
        return name if name in model_ids else None

    costs: dict[str, int] = {}
    for key, cost in raw.evict_costs.items():
        where = join_path(f"{base}.evict_costs", key)
        model = resolve(key)
        if model is None:
            issues.error(where, f"unknown var or model {key!r}")
        elif cost < 1:
            issues.error(where, f"{cost} is out of range; expected an integer >= 1")
        else:
            costs[model] = cost
    if not raw.sets:
        issues.error(f"{base}.sets", "required: at least one set")
        return None
    expanded = expand_sets(raw.sets, resolve, _hint(model_ids, variables))
    for problem in expanded.problems:
        issues.error(join_path(f"{base}.sets", problem.set_name), problem.message)
    if len(issues.errors) > errors:
        return None
    return MatrixRouter(
        sets=tuple(
            MatrixSet(name=name, models=models)
            for name, combinations in expanded.sets
            for models in combinations
        ),
        evict_costs=dict(sorted(costs.items())),
    )


def _hint(model_ids: set[str], variables: Mapping[str, str]) -> Callable[[str], str]:
    known = sorted(model_ids | variables.keys())

    def hint(name: str) -> str:
        close = difflib.get_close_matches(name, known, n=1)
        return f"; did you mean {close[0]!r}?" if close else ""

    return hint
