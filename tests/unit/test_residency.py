"""`app.core.residency`: llama-swap's group and matrix routers as pure functions.

The cases are llama-swap's (internal/router/group_test.go, matrix_test.go,
internal/matrix/dsl_test.go), asked of `to_evict` directly: which resident
models must stop for the target to load.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.config.matrix import expand_sets
from app.core.residency import (
    DEFAULT_GROUP,
    Group,
    GroupRouter,
    MatrixRouter,
    MatrixSet,
    PreloadPlan,
    Skipped,
    can_coexist,
    describe,
    one_at_a_time,
    plan_preload,
    to_evict,
)


def groups(*items: Group) -> GroupRouter:
    return GroupRouter(groups=items)


def group(name: str, *members: str, swap: bool = True, exclusive: bool = True, **kw: bool) -> Group:
    return Group(name=name, members=members, swap=swap, exclusive=exclusive, **kw)


def matrix(sets: Mapping[str, str], costs: Mapping[str, int] | None = None) -> MatrixRouter:
    def resolve(name: str) -> str:
        return name  # every name is a model here

    expanded = expand_sets(sets, resolve)
    assert not expanded.problems
    return MatrixRouter(
        sets=tuple(
            MatrixSet(name=name, models=models)
            for name, combos in expanded.sets
            for models in combos
        ),
        evict_costs=dict(costs or {}),
    )


def evict(
    router: GroupRouter | MatrixRouter | None, target: str, resident: Set[str]
) -> frozenset[str]:
    """`to_evict` asked as the scheduler asks it, with a frozen resident set (so
    through the router's memo: once computed, once remembered), and checked
    against a plain set, which is computed afresh every time."""
    afresh = to_evict(router, target, set(resident))
    remembered = [to_evict(router, target, frozenset(resident)) for _ in range(2)]
    assert remembered == [afresh, afresh], (target, resident)
    return afresh


# -- no router: one model at a time


@given(st.text(min_size=1, max_size=3), st.text(min_size=1, max_size=3))
def test_without_a_router_loading_a_model_evicts_the_other_one(target: str, other: str) -> None:
    expected = frozenset() if other == target else frozenset({other})
    assert evict(None, target, {other}) == expected


def test_without_a_router_everything_else_is_evicted() -> None:
    assert evict(None, "a", {"a", "b", "c"}) == {"b", "c"}
    assert evict(None, "a", set()) == frozenset()


# -- groups (group_test.go)


def test_group_swap_stops_the_resident_sibling() -> None:
    router = groups(group("g", "a", "b"))
    assert evict(router, "b", {"a"}) == {"a"}


def test_group_without_swap_keeps_its_members_together() -> None:
    # The first measurement: in a swap: false group, asking for B stopped A.
    router = groups(group("g", "a", "b", swap=False, exclusive=False))
    assert evict(router, "b", {"a"}) == frozenset()


def test_exclusive_group_stops_other_groups() -> None:
    router = groups(group("g1", "a"), group("g2", "b"))
    assert evict(router, "b", {"a"}) == {"a"}


def test_non_exclusive_groups_load_side_by_side() -> None:
    router = groups(group("g1", "a", exclusive=False), group("g2", "b", exclusive=False))
    assert evict(router, "a", {"b"}) == frozenset()
    assert evict(router, "b", {"a"}) == frozenset()


def test_same_group_swap_applies_to_a_load_in_flight() -> None:
    # The scheduler counts a load in flight as resident; the swap still applies.
    router = groups(group("g", "a", "b", exclusive=False))
    assert evict(router, "b", {"a"}) == {"a"}


def test_persistent_group_is_not_evicted_by_an_exclusive_one() -> None:
    router = groups(
        group("persist", "a", exclusive=False, persistent=True),
        group("other", "b"),
    )
    assert evict(router, "b", {"a"}) == frozenset()


def test_persistent_group_still_swaps_its_own_members() -> None:
    router = groups(group("persist", "a", "c", persistent=True), group("other", "b"))
    assert evict(router, "c", {"a", "b"}) == {"a", "b"}


def test_non_exclusive_target_leaves_a_resident_exclusive_group() -> None:
    # llama-swap keeps this gotcha of its old ProcessGroup; order matters.
    router = groups(group("g1", "a"), group("g2", "b", exclusive=False))
    assert evict(router, "b", {"a"}) == frozenset()
    assert evict(router, "a", {"b"}) == {"b"}
    assert can_coexist(router, ["a", "b"])
    assert not can_coexist(router, ["b", "a"])


def test_llm_embeddings_and_whisper_share_the_gpu() -> None:
    router = groups(
        group("llm", "qwen", "llama", exclusive=False),
        group("helpers", "embed", "whisper", swap=False, exclusive=False, persistent=True),
    )
    assert evict(router, "llama", {"qwen", "embed", "whisper"}) == {"qwen"}
    assert evict(router, "whisper", {"qwen", "embed"}) == frozenset()


def test_a_resident_model_of_no_group_counts_as_non_persistent() -> None:
    router = groups(group("g", "a"))
    assert evict(router, "a", {"gone"}) == {"gone"}


def test_a_target_of_no_group_is_a_callers_mistake() -> None:
    with pytest.raises(ValueError, match="'x' is in no group"):
        evict(groups(group("g", "a")), "x", set())


# -- matrix (matrix_test.go, dsl_test.go)


def test_matrix_evicts_what_shares_no_set_with_the_target() -> None:
    router = matrix({"s_a": "a", "s_b": "b"})
    assert evict(router, "b", {"a"}) == {"a"}


def test_matrix_keeps_what_shares_a_set() -> None:
    router = matrix({"s_ab": "a & b"})
    assert evict(router, "b", {"a"}) == frozenset()
    assert evict(router, "a", set()) == frozenset()


def test_matrix_pair_coexists() -> None:
    # The measurement: `pair: "a & b"` ran a and b one at a time.
    assert can_coexist(matrix({"pair": "a & b"}), ["a", "b"])


def test_matrix_equal_costs_go_to_the_earlier_set() -> None:
    router = matrix({"first": "a & b", "second": "a & c"})
    best = router.best_set("a", frozenset())
    assert best is not None and best[0].name == "first"
    assert evict(router, "a", {"b", "c"}) == {"c"}


def test_matrix_keeps_the_expensive_model() -> None:
    router = matrix({"a_with_c": "a & c", "a_with_b": "a & b"}, {"b": 10, "c": 1})
    assert evict(router, "a", {"b", "c"}) == {"c"}
    best = router.best_set("a", {"b", "c"})
    assert best is not None and (best[0].name, best[1]) == ("a_with_b", 1)


def test_matrix_default_cost_is_one_each() -> None:
    # Evicting b and c (1 + 1) costs more than evicting d (1).
    router = matrix({"keep_d": "a & d", "keep_bc": "a & b & c"})
    assert evict(router, "a", {"b", "c", "d"}) == {"d"}
    assert evict(
        matrix({"keep_d": "a & d", "keep_bc": "a & b & c"}, {"d": 3}), "a", {"b", "c", "d"}
    ) == {
        "b",
        "c",
    }


def test_matrix_subsets_of_a_set_are_allowed() -> None:
    router = matrix({"trio": "a & b & c"})
    assert evict(router, "b", {"a"}) == frozenset()


def test_matrix_overlapping_references() -> None:
    router = matrix({"base": "a & b", "extended": "target & +base & b"})
    assert evict(router, "target", {"a", "b"}) == frozenset()


def test_matrix_dominated_alternative() -> None:
    router = matrix({"preferred": "target & (a | (a & b))"})
    assert evict(router, "target", {"a", "b"}) == frozenset()


def test_matrix_a_target_in_no_set_runs_alone() -> None:
    router = matrix({"known": "a & b"})
    assert evict(router, "missing", {"a", "b"}) == {"a", "b"}


def test_matrix_a_resident_model_in_no_set_is_evicted() -> None:
    assert evict(matrix({"known": "a & b"}), "a", {"loner", "b"}) == {"loner"}


def test_matrix_a_resident_target_evicts_nothing() -> None:
    assert evict(matrix({"s_a": "a", "s_b": "b"}), "a", {"a", "b"}) == frozenset()


def test_matrix_product_keeps_the_running_choice_of_each_dimension() -> None:
    dims = [" | ".join(f"m{d}{c}" for c in range(4)) for d in range(3)]
    router = matrix({"large": "target & " + " & ".join(f"({d})" for d in dims)})
    running = {"m03", "m13", "m23", "outside"}
    assert evict(router, "target", running) == {"outside"}


def test_matrix_more_than_64_models_in_one_set() -> None:
    models = [f"model-{i}" for i in range(70)]
    router = matrix({"wide": " & ".join(["target", *models])})
    assert evict(router, "target", {*models, "outside"}) == {"outside"}


# -- invariants


names = st.sampled_from("abcdef")


@st.composite
def group_routers(draw: st.DrawFn) -> GroupRouter:
    models = list("abcdef")
    cuts = sorted(draw(st.sets(st.integers(1, 5), max_size=4)))
    bounds = [0, *cuts, len(models)]
    return GroupRouter(
        groups=tuple(
            Group(
                name=f"g{i}",
                members=tuple(models[lo:hi]),
                swap=draw(st.booleans()),
                exclusive=draw(st.booleans()),
                persistent=draw(st.booleans()),
            )
            for i, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False))
        )
    )


@given(group_routers(), names, st.frozensets(names))
def test_group_evictions_are_resident_and_never_the_target(
    router: GroupRouter, target: str, resident: frozenset[str]
) -> None:
    evicted = to_evict(router, target, resident)
    assert evicted <= resident and target not in evicted


matrix_sets = st.lists(st.frozensets(names, min_size=1), min_size=1, max_size=5)


def _matrix_of(sets: list[frozenset[str]]) -> MatrixRouter:
    return MatrixRouter(sets=tuple(MatrixSet(name=f"s{i}", models=s) for i, s in enumerate(sets)))


@given(matrix_sets, names, st.frozensets(names))
def test_matrix_keeps_a_set_that_holds_the_target(
    sets: list[frozenset[str]], target: str, resident: frozenset[str]
) -> None:
    router = MatrixRouter(sets=tuple(MatrixSet(name=f"s{i}", models=s) for i, s in enumerate(sets)))
    evicted = to_evict(router, target, resident)
    assert evicted <= resident and target not in evicted
    kept = (resident - evicted) | {target}
    if target not in resident:
        assert len(kept) == 1 or any(kept <= s for s in sets)
        # No set costs less than the one chosen.
        cost = len(evicted)
        assert all(len(resident - s) >= cost for s in sets if target in s)


@given(st.one_of(group_routers(), matrix_sets.map(_matrix_of)), st.frozensets(names))
def test_a_remembered_answer_is_the_one_computed_afresh(
    router: GroupRouter | MatrixRouter, resident: frozenset[str]
) -> None:
    """`to_evict` remembers a router's answers for frozen resident sets: each
    target over the same resident set, and the same target over another one,
    answers as a plain set (never remembered) and a decoded copy of the router
    do, and the memo is not part of the router's encoding."""
    queries = [(target, r) for target in "abcdef" for r in (resident, frozenset())]
    remembered = {query: to_evict(router, *query) for query in queries}
    encoded = msgspec.json.encode(router)
    copy = msgspec.json.decode(encoded, type=type(router))
    assert copy == router
    assert set(msgspec.json.decode(encoded)) == {"type", *type(router).__struct_fields__}
    for (target, r), answer in remembered.items():
        assert to_evict(router, target, r) == answer, (target, r)
        assert to_evict(router, target, set(r)) == answer, (target, r)
        assert to_evict(copy, target, set(r)) == answer, (target, r)


def test_the_memo_tells_targets_and_resident_sets_apart() -> None:
    router = matrix({"pair": "a & b", "solo": "c"})
    both = frozenset({"a", "b"})
    assert to_evict(router, "a", both) == frozenset()
    assert to_evict(router, "c", both) == both
    assert to_evict(router, "c", frozenset({"a"})) == {"a"}
    assert to_evict(router, "a", both) == frozenset()


# -- preload and coexistence


def test_preload_without_a_router_keeps_the_last_as_llama_swap_does() -> None:
    # llama-swap preloads one model after the other: each swaps the last out.
    assert plan_preload(None, ["a", "c"]) == PreloadPlan(
        load=("c",), skipped=(Skipped(model="a", evicted_by="c"),)
    )
    assert plan_preload(None, ["a", "c", "a"]) == PreloadPlan(
        load=("a",), skipped=(Skipped(model="c", evicted_by="a"),)
    )


def test_preload_loads_two_non_exclusive_groups() -> None:
    router = groups(group("g1", "a", "b", exclusive=False), group("g2", "c", exclusive=False))
    assert plan_preload(router, ["a", "c", "a"]) == PreloadPlan(load=("a", "c"))


def test_preload_keeps_the_last_of_a_swap_group_and_the_other_lanes() -> None:
    router = groups(group("g1", "a", "b", exclusive=False), group("g2", "c", exclusive=False))
    plan = plan_preload(router, ["a", "b", "c"])
    assert plan.load == ("b", "c")
    assert plan.skipped == (Skipped(model="a", evicted_by="b"),)


def test_preload_under_a_matrix() -> None:
    router = matrix({"pair": "a & b", "solo": "c"})
    plan = plan_preload(router, ["a", "b", "c"])
    assert plan.load == ("c",)
    assert set(plan.skipped) == {
        Skipped(model="a", evicted_by="c"),
        Skipped(model="b", evicted_by="c"),
    }


def test_can_coexist() -> None:
    assert can_coexist(None, ["a"])
    assert not can_coexist(None, ["a", "b"])
    assert can_coexist(matrix({"pair": "a & b"}), ["b", "a"])
    assert not can_coexist(matrix({"pair": "a & b"}), ["a", "c"])


def test_describe_names_the_router() -> None:
    router = groups(group("llm", "a"), group(DEFAULT_GROUP, "b"))
    assert describe(router) == "group router (2 groups: llm, (default))"
    assert describe(matrix({"x": "a | b", "y": "c"})) == "matrix router (3 model sets from: x, y)"
    assert describe(None) == "no router (one model at a time)"


# -- one model at a time (the replay's one-lane loop)


def test_routers_that_allow_one_model_at_a_time() -> None:
    models = ("a", "b", "c")
    assert one_at_a_time(None, models)
    assert one_at_a_time(groups(group("all", *models)), models)
    # three exclusive groups of one: each load evicts the others
    assert one_at_a_time(groups(*(group(m, m) for m in models)), models)
    assert one_at_a_time(matrix({"x": "a", "y": "b", "z": "c"}), models)
    # a matrix model in no set runs alone
    assert one_at_a_time(matrix({"x": "a"}), models)


def test_routers_that_let_two_models_be_resident_together() -> None:
    models = ("a", "b", "c")
    assert not one_at_a_time(groups(group("all", *models, swap=False)), models)
    assert not one_at_a_time(
        groups(group("g0", "a", exclusive=False), group("g1", "b", "c", exclusive=False)), models
    )
    assert not one_at_a_time(
        groups(group("llm", "a", "b"), group("p", "c", persistent=True)), models
    )
    assert not one_at_a_time(matrix({"x": "a & b", "y": "c"}), models)
