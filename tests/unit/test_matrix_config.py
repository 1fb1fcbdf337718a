"""`app.config.matrix`: llama-swap's matrix expressions, parsed and expanded.

Cases from llama-swap's internal/matrix/dsl_test.go and
internal/config/matrix_test.go, plus the position in every error.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from app.config.matrix import (
    MAX_EXPANDED,
    All,
    AnyOf,
    ExpressionError,
    Name,
    Ref,
    SetProblem,
    expand_sets,
    parse,
)

MODELS = frozenset({"a", "b", "c", "d", "e", "g", "q", "m", "v", "target", "model-name.v2"})


def known(name: str) -> str | None:
    return name if name in MODELS else None


def expand(sets: Mapping[str, str]) -> list[tuple[str, list[set[str]]]]:
    result = expand_sets(sets, known)
    assert result.problems == ()
    return [(name, [set(s) for s in combos]) for name, combos in result.sets]


def problems(sets: Mapping[str, str]) -> list[tuple[str, str]]:
    result = expand_sets(sets, known)
    assert result.sets == ()
    return [(p.set_name, p.message) for p in result.problems]


def test_parse_names_refs_and_precedence() -> None:
    assert parse("model-name.v2") == Name("model-name.v2", 1)
    assert parse("(a | +base) & b") == All((AnyOf((Name("a", 2), Ref("base", 6))), Name("b", 15)))
    # & binds tighter than |
    assert parse("a | b & c") == AnyOf((Name("a", 1), All((Name("b", 5), Name("c", 9)))))


@pytest.mark.parametrize(
    ("dsl", "expected"),
    [
        ("a", [{"a"}]),
        ("a & b", [{"a", "b"}]),
        ("a | b | c", [{"a"}, {"b"}, {"c"}]),
        ("(a | b) & (c | d)", [{"a", "c"}, {"a", "d"}, {"b", "c"}, {"b", "d"}]),
        ("a | b & c", [{"a"}, {"b", "c"}]),
        ("a & a", [{"a"}]),
        ("a | a", [{"a"}]),
        ("  a&b  ", [{"a", "b"}]),
    ],
)
def test_expressions_expand_in_order(dsl: str, expected: list[set[str]]) -> None:
    assert expand({"test": dsl}) == [("test", expected)]


def test_references_expand_and_come_first() -> None:
    sets = {"mega": "+with_tts & e", "with_tts": "+llms & v", "llms": "g | q | m", "solo": "a"}
    result = expand(sets)
    assert [name for name, _ in result] == ["llms", "with_tts", "mega", "solo"]
    assert dict(result)["mega"] == [{"e", "g", "v"}, {"e", "q", "v"}, {"e", "m", "v"}]


def test_vars_resolve_to_models() -> None:
    variables = {"L": "long/model:q4"}
    result = expand_sets({"s": "L & a"}, lambda n: variables.get(n) or known(n))
    assert result.sets == (("s", (frozenset({"long/model:q4", "a"}),)),)


@pytest.mark.parametrize(
    ("dsl", "message"),
    [
        ("", "empty expression; expected model names joined by `&` and `|`"),
        ("   ", "empty expression; expected model names joined by `&` and `|`"),
        (
            "(a",
            "at position 3: expected `)` to close the `(` at position 1, "
            "got the end of the expression",
        ),
        ("a)", "at position 2: expected `&`, `|` or the end of the expression, got `)`"),
        ("()", "at position 2: expected a model or var name, `+set` or `(`, got `)`"),
        (
            "a &",
            "at position 4: expected a model or var name, `+set` or `(`, "
            "got the end of the expression",
        ),
        ("a b", "at position 3: expected `&`, `|` or the end of the expression, got `b`"),
        ("| a", "at position 1: expected a model or var name, `+set` or `(`, got `|`"),
        ("+", "at position 2: expected a set name after `+`"),
        ("a & + b", "at position 6: expected a set name after `+`"),
    ],
)
def test_syntax_errors_name_the_position_and_what_was_expected(dsl: str, message: str) -> None:
    with pytest.raises(ExpressionError) as caught:
        parse(dsl)
    assert str(caught.value) == message
    assert problems({"s": dsl}) == [("s", message)]


def test_an_odd_character_is_named() -> None:
    with pytest.raises(ExpressionError, match=r"at position 3: unexpected character '@'; .*`vars`"):
        parse("a @ b")


def test_unknown_names_and_refs_are_all_reported() -> None:
    assert problems({"s": "a & missing", "t": "+nowhere | b", "u": "zz"}) == [
        ("s", "at position 5: unknown var or model 'missing'"),
        ("t", "at position 1: `+nowhere` names no set"),
        ("u", "at position 1: unknown var or model 'zz'"),
    ]


def test_unknown_names_get_a_hint() -> None:
    result = expand_sets({"s": "tagret"}, known, lambda n: "; did you mean 'target'?")
    assert result.problems == (
        SetProblem("s", "at position 1: unknown var or model 'tagret'; did you mean 'target'?"),
    )


def test_reference_cycles_are_errors() -> None:
    assert problems({"a": "+b", "b": "+a"}) == [
        ("a", "sets refer to each other in a cycle: `+a` -> `+b` -> `+a`")
    ]
    assert problems({"self": "a | +self"}) == [
        ("self", "sets refer to each other in a cycle: `+self` -> `+self`")
    ]


def test_an_entry_too_wide_to_expand_is_an_error() -> None:
    # 8 dimensions of 4 choices: 65536 sets. llama-swap solves these without
    # expanding them; gpulane expands, so it bounds the width.
    dims = " & ".join("(" + " | ".join(f"m{d}_{c}" for c in range(4)) + ")" for d in range(8))
    names = {f"m{d}_{c}" for d in range(8) for c in range(4)}
    result = expand_sets({"wide": dims}, lambda n: n if n in names else None)
    assert result.problems == (
        SetProblem(
            "wide",
            f"expands to more than {MAX_EXPANDED} model sets; split it into several entries",
        ),
    )
