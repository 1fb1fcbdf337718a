"""X-LlamaSwap-Priority parsing and band labels (DESIGN.md, the scheduling policy)."""

from __future__ import annotations

import pytest

from app.core.priority import ALIASES, HEADER, band_of, parse_priority


def test_header_name_is_llama_swaps() -> None:
    assert HEADER == "X-LlamaSwap-Priority"


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "   ",
        "abc",
        "high",
        "1e3",
        "0x10",
        "0b1",
        "1.5",
        "1,000",
        "1_000",
        "1 000",
        "+",
        "-",
        "--5",
        "+-5",
        "5-",
        "٣",  # Arabic-Indic three
        "-٣",
        "١٠٠",  # Arabic-Indic 100
        "１",  # fullwidth one
        "１００",  # fullwidth 100
        "²",  # superscript two: str.isdigit() is True for it
        "interactive!",
        "inter active",
        "batch,normal",
    ],
)
def test_unparseable_values_parse_as_0(value: str | None) -> None:
    assert parse_priority(value) == 0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("+5", 5),
        (" -7 ", -7),
        ("-7", -7),
        ("42", 42),
        ("\t12\n", 12),
        ("007", 7),
        ("-0", 0),
        ("100", 100),
        ("-100", -100),
        ("-98", -98),
        ("102", 102),
    ],
)
def test_signed_ascii_integers_with_surrounding_spaces_parse(value: str, expected: int) -> None:
    assert parse_priority(value) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("interactive", 100),
        ("INTERACTIVE", 100),
        (" Interactive ", 100),
        ("normal", 0),
        ("NoRmAl", 0),
        ("  normal\t", 0),
        ("batch", -100),
        ("BATCH", -100),
        ("\tBatch  ", -100),
    ],
)
def test_aliases_are_case_insensitive_and_ignore_surrounding_spaces(
    value: str, expected: int
) -> None:
    assert parse_priority(value) == expected
    assert ALIASES[value.strip().lower()] == expected


@pytest.mark.parametrize("sign", ["", "+", "-"])
def test_a_30_digit_value_is_kept_exactly_not_clamped(sign: str) -> None:
    digits = "123456789012345678901234567890"
    assert len(digits) == 30
    expected = int(digits) * (-1 if sign == "-" else 1)
    assert parse_priority(f" {sign}{digits} ") == expected


def test_a_value_too_long_for_int_parses_as_0_instead_of_failing_the_request() -> None:
    # int() refuses more than sys.int_max_str_digits (4300) digits with ValueError;
    # a malformed header must never fail a request.
    assert parse_priority("9" * 5000) == 0
    assert parse_priority("-" + "9" * 5000) == 0
    assert parse_priority("9" * 4300) == int("9" * 4300)


@pytest.mark.parametrize(
    ("priority", "band"),
    [
        (10**30, "interactive"),
        (102, "interactive"),
        (100, "interactive"),
        (50, "interactive"),
        (49, "normal"),
        (0, "normal"),
        (-49, "normal"),
        (-50, "batch"),
        (-98, "batch"),
        (-100, "batch"),
        (-(10**30), "batch"),
    ],
)
def test_band_boundaries_are_50_and_minus_50_inclusive(priority: int, band: str) -> None:
    assert band_of(priority) == band


@pytest.mark.parametrize(
    ("alias", "band"), [("interactive", "interactive"), ("normal", "normal"), ("batch", "batch")]
)
def test_each_alias_lands_in_its_own_band(alias: str, band: str) -> None:
    assert band_of(parse_priority(alias)) == band
