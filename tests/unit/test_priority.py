"""X-LlamaSwap-Priority parsing, band labels (DESIGN.md, the scheduling policy) and
the priority a caller is granted (its key's maxPriority and defaultPriority,
OpenAI's service_tier)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.core.priority import (
    ALIASES,
    HEADER,
    MAX_PRIORITY,
    MIN_PRIORITY,
    SERVICE_TIERS,
    band_of,
    grant,
    parse_priority,
    read_priority,
    read_priority_setting,
    requested_priority,
    tier_priority,
    unreadable_priority,
)
from app.core.scoring import NS_PER_S, ScoringParams


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


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (str(2**63 - 1), 2**63 - 1),
        (f"+{2**63 - 1}", 2**63 - 1),
        (str(-(2**63)), -(2**63)),
        (" 0009223372036854775807 ", 2**63 - 1),  # leading zeros do not count
        ("0" * 5000 + "42", 42),
    ],
)
def test_the_whole_signed_64_bit_range_is_kept_exactly_not_clamped(
    value: str, expected: int
) -> None:
    assert parse_priority(value) == expected
    assert (MIN_PRIORITY, MAX_PRIORITY) == (-(2**63), 2**63 - 1)


@pytest.mark.parametrize(
    "value",
    [
        str(2**63),
        f"+{2**63}",
        str(-(2**63) - 1),
        "123456789012345678901234567890",
        "-123456789012345678901234567890",
        "9" * 309,  # float(priority) overflowed from here: the score broke for everyone
        "-" + "9" * 309,
        "9" * 4300,  # the most digits int() converts by default
        "-" + "9" * 4300,
        "9" * 5000,  # int() refuses these with ValueError
    ],
    ids=lambda v: f"{len(v)}-chars",
)
def test_values_outside_the_signed_64_bit_range_parse_as_0_as_in_the_fork(value: str) -> None:
    assert parse_priority(value) == 0


@pytest.mark.parametrize("digits", [309, 4300])
def test_an_out_of_range_header_scores_like_priority_0(digits: int) -> None:
    # What broke: the breakdown's float of a 309+ digit priority overflowed.
    params = ScoringParams()
    parsed = parse_priority("9" * digits)
    enqueued, now = 5 * NS_PER_S, 65 * NS_PER_S
    assert params.breakdown(parsed, enqueued, now, resident=True) == params.breakdown(
        0, enqueued, now, resident=True
    )


@pytest.mark.parametrize("priority", [MAX_PRIORITY, MIN_PRIORITY])
def test_the_score_of_an_extreme_priority_is_finite(priority: int) -> None:
    params = ScoringParams()
    b = params.breakdown(priority, 0, 3600 * NS_PER_S, resident=True)
    assert math.isfinite(b.total) and b.priority == priority
    assert params.base_key(priority, 0) == priority * params.aging_divisor_ns


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


# --- the priority policy of a caller (issue 12: a key caps and defaults its priority) ---

GRANTS = [
    # (asked, maxPriority, defaultPriority) -> granted
    ((None, None, 0), 0),  # nothing asked, no key: normal
    ((None, None, -98), -98),  # nothing asked: the key's default
    ((100, None, -98), 100),  # asked: the default does not apply
    ((102, 102, 0), 102),  # at the cap: kept
    ((200, 102, 0), 102),  # above the cap: lowered to it
    ((100, 0, 0), 0),  # a free key asking for interactive gets normal+0
    ((-100, 0, 0), -100),  # below the cap: kept (a cap never raises)
    ((MAX_PRIORITY, 0, 0), 0),
    ((MIN_PRIORITY, 0, 0), MIN_PRIORITY),
    ((None, 0, -98), -98),
]


@pytest.mark.parametrize(("args", "granted"), GRANTS)
def test_grant_lowers_to_the_cap_and_fills_in_the_default(
    args: tuple[int | None, int | None, int], granted: int
) -> None:
    asked, cap, default = args
    assert grant(asked, cap, default) == granted


@given(
    asked=st.none() | st.integers(MIN_PRIORITY, MAX_PRIORITY),
    cap=st.none() | st.integers(MIN_PRIORITY, MAX_PRIORITY),
    default=st.integers(MIN_PRIORITY, MAX_PRIORITY),
)
def test_a_grant_never_exceeds_the_cap_and_is_what_was_asked_when_allowed(
    asked: int | None, cap: int | None, default: int
) -> None:
    granted = grant(asked, cap, default)
    wanted = default if asked is None else asked
    assert granted == (wanted if cap is None else min(wanted, cap))
    assert cap is None or granted <= cap


@pytest.mark.parametrize("value", [None, "", "   ", "high", "1e3", "9" * 400])
def test_an_absent_empty_or_unparseable_header_asks_for_nothing(value: str | None) -> None:
    # So a key's defaultPriority applies; without one, grant() gives 0 as before.
    assert read_priority(value) is None
    assert grant(read_priority(value)) == parse_priority(value) == 0


@given(st.text(alphabet=st.characters(max_codepoint=0xFF)))
def test_an_unreadable_header_comes_back_as_sent_and_safe_to_echo(value: str) -> None:
    # What the server decoded (latin-1, byte for byte); echoed in a response header.
    echoed = unreadable_priority(value)
    if read_priority(value) is not None or not value.strip():
        assert echoed is None
        return
    assert echoed is not None
    assert all(" " <= c <= "~" for c in echoed)  # printable ASCII: cannot break a header
    assert len(echoed) <= 4 * 64  # the first 64 characters, each at most \xNN
    if value.strip().isascii() and value.strip().isprintable():
        assert echoed == value.strip()[:64]  # as sent


@pytest.mark.parametrize(("value", "asked"), [("interactive", 100), (" -98 ", -98), ("0", 0)])
def test_a_parseable_header_asks_for_its_value(value: str, asked: int) -> None:
    assert read_priority(value) == asked == parse_priority(value)


@pytest.mark.parametrize(
    ("tier", "asked"),
    [(None, None), ("priority", 100), ("flex", -100), ("default", 0), ("auto", None)],
)
def test_openai_service_tiers_map_to_bands(tier: str | None, asked: int | None) -> None:
    # "auto" is OpenAI's "whatever the project is configured for": the key's default.
    assert tier_priority(tier) == asked
    assert set(SERVICE_TIERS) == {"priority", "flex", "default", "auto"}


@pytest.mark.parametrize("tier", ["scale", "PRIORITY", "", 1, True, {"a": 1}])
def test_an_unknown_service_tier_is_an_error_naming_the_allowed_values(tier: object) -> None:
    with pytest.raises(ValueError, match="auto, default, flex, priority"):
        tier_priority(tier)


@pytest.mark.parametrize(
    ("header", "tier", "asked"),
    [
        ("batch", "priority", -100),  # the header wins
        (None, "priority", 100),  # no header: the tier
        ("", "flex", -100),  # an empty header is no header
        ("nonsense", "flex", -100),  # so is an unparseable one
        (None, None, None),  # neither: the key's default
        (None, "auto", None),
    ],
)
def test_the_header_wins_over_the_service_tier(
    header: str | None, tier: str | None, asked: int | None
) -> None:
    assert requested_priority(header, tier) == asked


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("interactive+2", 102),
        (" Batch - 1 ", -101),
        ("normal", 0),
        ("-98", -98),
        ("+5", 5),
        ("interactive2", None),
        ("1.5", None),
        ("urgent", None),
    ],
)
def test_a_priority_setting_reads_bands_with_offsets(text: str, expected: int | None) -> None:
    # The config's grammar (apiKeys' maxPriority/defaultPriority) lives here too.
    assert read_priority_setting(text) == expected


def test_the_header_takes_the_configs_grammar_within_64_bits() -> None:
    assert read_priority("interactive+2") == 102
    assert read_priority("Batch - 1") == -101
    assert read_priority("normal+9223372036854775807") == 2**63 - 1
    assert read_priority("interactive+9223372036854775807") is None  # past 64 bits: 0
    assert read_priority("interactive+\u0663") is None  # ASCII digits only
    assert read_priority("interactive+") is None
