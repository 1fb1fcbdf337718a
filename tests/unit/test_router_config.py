"""Config loading of llama-swap's routers: `routing.router` and the top-level
`groups` / `matrix`, resolved into `Config.router`."""

from __future__ import annotations

import textwrap

import pytest

from app.config import Config, ConfigError, parse_config
from app.core.residency import (
    DEFAULT_GROUP,
    Group,
    GroupRouter,
    MatrixRouter,
    MatrixSet,
    to_evict,
)

MODELS = """
models:
  llm: {cmd: "server --port ${PORT}", aliases: [chat]}
  embed: {cmd: "server --port ${PORT}"}
  whisper: {cmd: "server --port ${PORT}"}
  "org/tts:q4": {cmd: "server --port ${PORT}"}
"""


def parse(text: str) -> Config:
    return parse_config(MODELS + textwrap.dedent(text))


def errors_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse(text)
    return caught.value.errors


def router_warnings(config: Config) -> list[str]:
    """Warnings about the router as a whole: none now that the run loop uses it."""
    return [w for w in config.warnings if "parsed but ignored" in w]


def test_no_router_is_one_model_at_a_time() -> None:
    config = parse("")
    assert config.router is None
    assert router_warnings(config) == []
    assert parse("routing: {router: {use: group}}").router is None


def test_routing_router_groups() -> None:
    config = parse(
        """
        routing:
          router:
            use: group
            settings:
              groups:
                helpers:
                  swap: false
                  exclusive: false
                  persistent: true
                  members: [embed, whisper]
                llms:
                  members: [chat]
        """
    )
    assert config.router == GroupRouter(
        groups=(
            Group(
                name="helpers",
                members=("embed", "whisper"),
                swap=False,
                exclusive=False,
                persistent=True,
            ),
            Group(name="llms", members=("llm",)),  # the alias resolved; llama-swap's defaults
            Group(name=DEFAULT_GROUP, members=("org/tts:q4",)),
        )
    )
    assert router_warnings(config) == []  # the run loop uses it
    assert to_evict(config.router, "llm", {"embed", "whisper", "org/tts:q4"}) == {"org/tts:q4"}


def test_top_level_groups_are_the_same_router() -> None:
    config = parse("groups:\n  pair: {swap: false, members: [llm, embed]}\n")
    assert isinstance(config.router, GroupRouter)
    assert config.router.groups[0] == Group(name="pair", members=("llm", "embed"), swap=False)
    assert router_warnings(config) == []


def test_group_member_errors() -> None:
    errors = errors_of(
        """
        groups:
          a: {members: [llm, llm, embd]}
          b: {members: [llm]}
          "(default)": {members: [whisper]}
        """
    )
    assert errors == [
        "groups.a.members[1]: model 'llm' is listed twice in group 'a'",
        "groups.b.members[0]: model 'llm' is already in group 'a'; "
        "a model may be in one group only",
        "groups.(default): '(default)' is reserved for the models no group names",
    ]


def test_a_member_naming_no_model_loads_with_a_warning_naming_it() -> None:
    # llama-swap checks members only for duplicates: its config.example.yaml
    # names models it does not define.
    config = parse("groups:\n  a: {members: [llm, embd]}\n")
    assert "groups.a.members[1]: unknown model 'embd', not a member; did you mean 'embed'?" in (
        config.warnings
    )
    group = next(g for g in config.router.groups if g.name == "a")
    assert group.members == ("llm",)


def test_routing_router_matrix() -> None:
    config = parse(
        """
        routing:
          router:
            use: matrix
            settings:
              matrix:
                vars: {tts: "org/tts:q4", l: llm}
                evict_costs: {l: 5}
                sets:
                  voice: "l & (tts | whisper)"
                  all: "+voice & embed"
        """
    )
    assert config.router == MatrixRouter(
        sets=(
            MatrixSet(name="voice", models=frozenset({"llm", "org/tts:q4"})),
            MatrixSet(name="voice", models=frozenset({"llm", "whisper"})),
            MatrixSet(name="all", models=frozenset({"llm", "org/tts:q4", "embed"})),
            MatrixSet(name="all", models=frozenset({"llm", "whisper", "embed"})),
        ),
        evict_costs={"llm": 5},
    )
    assert router_warnings(config) == []


def test_top_level_matrix() -> None:
    config = parse("matrix:\n  sets:\n    pair: llm & embed\n")
    assert config.router == MatrixRouter(
        sets=(MatrixSet(name="pair", models=frozenset({"llm", "embed"})),)
    )


def test_matrix_errors_name_the_set_and_position() -> None:
    errors = errors_of(
        """
        routing:
          router:
            use: matrix
            settings:
              matrix:
                vars: {"bad key!": llm, ok: nothere}
                evict_costs: {llm: 0, ghost: 2}
                sets:
                  pair: "llm & (embed"
                  other: "llm & whispr"
        """
    )
    base = "routing.router.settings.matrix"
    assert errors == [
        f"{base}.vars.bad key!: a var name is 1-32 letters, digits, `-` or `.`",
        f"{base}.vars.ok: unknown model 'nothere'",
        f"{base}.evict_costs.llm: 0 is out of range; expected an integer >= 1",
        f"{base}.evict_costs.ghost: unknown var or model 'ghost'",
        f"{base}.sets.pair: at position 13: expected `)` to close the `(` at position 7, "
        "got the end of the expression",
        f"{base}.sets.other: at position 7: unknown var or model 'whispr'; did you mean 'whisper'?",
    ]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            "routing: {router: {use: round-robin}}",
            "routing.router.use: 'round-robin' is not allowed; "
            "expected one of group, matrix, memory",
        ),
        (
            "routing: {router: {use: matrix}}",
            "routing.router.settings.matrix: required by routing.router.use: matrix",
        ),
        (
            "routing: {router: {use: matrix, settings: {matrix: {sets: {}}}}}",
            "routing.router.settings.matrix.sets: required: at least one set",
        ),
        (
            "groups: {g: {members: [llm]}}\nrouting: {router: {use: group}}",
            "routing.router: cannot be used together with the top-level `groups` / `matrix`; "
            "move them into routing.router.settings",
        ),
        (
            "groups: {g: {members: [llm]}}\nmatrix: {sets: {s: llm}}",
            "matrix: cannot be used together with `groups`; use one router",
        ),
        (
            "routing: {router: {settings: {groups: {g: {swop: true}}}}}",
            "routing.router.settings.groups.g.swop: unknown key; did you mean 'swap'?",
        ),
    ],
)
def test_router_config_errors(text: str, error: str) -> None:
    assert errors_of(text) == [error]


def test_the_unused_router_settings_warn() -> None:
    config = parse(
        """
        routing:
          router:
            use: matrix
            settings:
              groups: {g: {members: [llm]}}
              matrix: {sets: {s: llm}}
        """
    )
    assert isinstance(config.router, MatrixRouter)
    assert "routing.router.settings.groups: not used: routing.router.use is matrix" in (
        config.warnings
    )


def test_a_router_changes_the_hash_and_no_router_keeps_it() -> None:
    plain = parse("")
    grouped = parse("groups:\n  pair: {swap: false, members: [llm, embed]}\n")
    assert plain.config_hash != grouped.config_hash
    assert parse("").config_hash == plain.config_hash


def test_preload_is_resolved_to_model_ids() -> None:
    config = parse("hooks: {on_startup: {preload: [chat, embed]}}")
    assert config.preload == ("llm", "embed")


def test_a_preload_the_router_cannot_keep_together_is_warned_of() -> None:
    config = parse(
        """
        groups:
          llms: {members: [llm, whisper]}
          helpers: {swap: false, exclusive: false, members: [embed]}
        hooks:
          on_startup:
            preload: [llm, embed, whisper]
        """
    )
    assert config.preload == ("llm", "embed", "whisper")
    preload = [w for w in config.warnings if w.startswith("hooks.on_startup.preload")]
    # Loaded in turn, as llama-swap does: whisper (exclusive) evicts both.
    assert preload == [
        "hooks.on_startup.preload: 'embed' is not kept preloaded: with group router "
        "(3 groups: llms, helpers, (default)), 'whisper', listed after it, evicts it "
        "(models are preloaded in turn, as llama-swap does: the last of those that "
        "cannot be resident together stays)",
        "hooks.on_startup.preload: 'llm' is not kept preloaded: with group router "
        "(3 groups: llms, helpers, (default)), 'whisper', listed after it, evicts it "
        "(models are preloaded in turn, as llama-swap does: the last of those that "
        "cannot be resident together stays)",
    ]
    warned = parse("hooks: {on_startup: {preload: [llm, embed]}}").warnings
    assert [w for w in warned if "preload" in w] == [
        "hooks.on_startup.preload: 'llm' is not kept preloaded: with no router (one "
        "model at a time), 'embed', listed after it, evicts it (models are preloaded in "
        "turn, as llama-swap does: the last of those that cannot be resident together stays)"
    ]
