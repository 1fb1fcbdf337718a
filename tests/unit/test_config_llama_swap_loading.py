"""Configs llama-swap loads, load; what it refuses, is refused (issue 28, item 1).

Each test is one of the differences measured against llama-swap's loader
(`internal/config/load.go`, `macros.go`): macros substituted in the YAML tree
before it is typed, peers-only configs, anchor blocks and unknown keys, group
members, `logLevel`'s case, and the macro rules llama-swap enforces.
"""

from __future__ import annotations

import textwrap

import pytest

from app.config import Config, ConfigError, parse_config

MODEL = "models:\n  m:\n    cmd: srv --port ${PORT}\n"


def parse(text: str, environ: dict[str, str] | None = None) -> Config:
    return parse_config(textwrap.dedent(text), environ=environ or {})


def errors_of(text: str, environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse(text, environ)
    return caught.value.errors


# --- what llama-swap loads -------------------------------------------------------


def test_a_defs_block_of_yaml_anchors_loads_without_a_warning() -> None:
    config = parse(
        """
        defs:
          caps: &caps {in: [text, image]}
          llama: &llama "srv --port ${PORT}"
        models:
          a: {cmd: *llama, capabilities: *caps}
        """
    )
    assert config.models["a"].cmd == ("srv", "--port", "5800")
    assert not [w for w in config.warnings if w.startswith("defs")]


def test_an_x_block_loads_quietly_and_another_unknown_key_with_a_warning_naming_it() -> None:
    config = parse(
        """
        x-common: &c {ttl: 30}
        colour: blue
        models:
          a: {cmd: "srv --port ${PORT}", ttl: 30}
        """
    )
    assert "colour: unknown key ignored, as llama-swap ignores it" in config.warnings
    assert not [w for w in config.warnings if w.startswith("x-common")]


@pytest.mark.parametrize(("typo", "meant"), [("modles", "models"), ("globalTtl", "globalTTL")])
def test_an_unknown_key_one_edit_from_a_known_one_is_an_error_naming_it(
    typo: str, meant: str
) -> None:
    errors = errors_of(f"{typo}: {{}}\n" + MODEL)
    assert errors == [f"{typo}: unknown key; did you mean {meant!r}?"]


def test_macros_in_typed_fields_keep_the_macros_type() -> None:
    config = parse(
        """
        macros:
          FIRST_PORT: 9100
          GLOBAL_TTL: 120
          LOADING: true
          t: 45
        startPort: ${FIRST_PORT}
        globalTTL: "${GLOBAL_TTL}"
        sendLoadingState: ${LOADING}
        models:
          a: {cmd: "srv --port ${PORT}", ttl: "${t}"}
          b: {cmd: "srv --port ${PORT}"}
        """
    )
    assert (config.start_port, config.send_loading_state) == (9100, True)
    assert (config.models["a"].ttl, config.models["b"].ttl) == (45, 120)
    assert config.models["a"].port == 9100


def test_macros_are_substituted_in_every_value_of_a_model() -> None:
    config = parse(
        """
        macros: {t: 0.7, family: qwen}
        models:
          m:
            macros: {size: 7b}
            cmd: srv --port ${PORT}
            useModelName: ${family}-${size}
            name: "${family} ${size}"
            description: "${MODEL_ID} on port ${PORT}"
            aliases: ["${family}", "${MODEL_ID}-on-${PORT}"]
            filters:
              setParams: {temperature: "${t}", note: "t=${t}", port: "${PORT}"}
              setParamsByID:
                "${MODEL_ID}:cold": {temperature: "${t}"}
        """
    )
    m = config.models["m"]
    assert (m.use_model_name, m.name, m.description) == ("qwen-7b", "qwen 7b", "m on port 5800")
    assert m.aliases == ("qwen", "m-on-5800", "m:cold")
    # A lone macro is sent upstream as the number, as llama-swap sends it.
    assert m.set_params == {"temperature": 0.7, "note": "t=0.7", "port": 5800}
    assert m.set_params_by_id == {"m:cold": {"temperature": 0.7}}


def test_a_config_of_peers_only_loads() -> None:
    config = parse(
        """
        peers:
          box: {proxy: "http://box:8080", models: [a]}
        """
    )
    assert list(config.models) == ["box/a"]
    assert config.name_index["a"] == "box/a"
    assert not [w for w in config.warnings if w.startswith("models")]


@pytest.mark.parametrize("text", ["", "logLevel: info\n"])
def test_a_config_with_nothing_to_serve_loads_with_a_warning(text: str) -> None:
    config = parse(text)
    assert config.models == {}
    assert config.warnings == ("models: no models and no peers: there is nothing to serve",)


@pytest.mark.parametrize("given", ["INFO", "Debug", " warn "])
def test_log_level_ignores_case(given: str) -> None:
    assert parse(f"logLevel: {given!r}\n" + MODEL).log_level == given.strip().lower()


def test_a_full_url_check_endpoint_is_checked_by_its_path_on_the_models_proxy() -> None:
    # llama-swap sends the check through the model's reverse proxy, which keeps the path.
    config = parse(MODEL + "    checkEndpoint: http://myserver/health?ready=1\n")
    assert config.models["m"].check_endpoint == "/health?ready=1"
    assert (
        "models.m.checkEndpoint: 'http://myserver/health?ready=1' is checked on the model's "
        "proxy as '/health?ready=1'"
    ) in config.warnings


# --- what llama-swap refuses -----------------------------------------------------


@pytest.mark.parametrize("key", ["name", "description", "useModelName", "aliases[0]"])
def test_an_unknown_macro_in_any_model_value_is_refused_naming_the_key(key: str) -> None:
    field, _, index = key.partition("[")
    value = '["x ${nope}"]' if index else '"x ${nope}"'
    errors = errors_of(MODEL + f"    {field}: {value}\n")
    assert errors == [f"models.m.{key}: unknown macro ${{nope}}"]


def test_a_forward_macro_reference_is_refused() -> None:
    # llama-swap's TestConfig_MacroForwardReferenceRejected.
    errors = errors_of('macros: {FIRST: "v-${SECOND}", SECOND: later}\n' + MODEL)
    assert errors == [
        "macros.FIRST: uses ${SECOND}, which is defined after it; a macro may use only the "
        "macros defined before it"
    ]


def test_set_params_by_id_keys_that_resolve_to_one_id_are_refused() -> None:
    errors = errors_of(
        """
        macros: {FIRST: shared, SECOND: shared}
        models:
          m:
            cmd: srv --port ${PORT}
            filters:
              setParamsByID:
                "${FIRST}": {temperature: 0.1}
                "${SECOND}": {temperature: 0.2}
        """
    )
    assert errors == [
        "models.m.filters.setParamsByID.${SECOND}: resolves to 'shared', as '${FIRST}' does; "
        "each key must be a distinct id"
    ]


def test_an_unused_model_macro_still_needs_its_environment_variable() -> None:
    errors = errors_of(MODEL + '    macros: {dir: "${env.NOPE}/x"}\n')
    assert errors == [
        "models.m.macros.dir: environment variable NOPE is not set (used as ${env.NOPE})"
    ]


def test_an_environment_value_with_a_newline_is_refused() -> None:
    errors = errors_of(
        "models:\n  m:\n    cmd: srv --port ${PORT} ${env.MULTI}\n", {"MULTI": "a\nb"}
    )
    assert errors == ["models.m.cmd: environment variable MULTI contains a newline or a null byte"]


def test_an_api_key_with_a_space_is_refused() -> None:
    errors = errors_of('apiKeys: ["key 123"]\n' + MODEL)
    assert errors == ["apiKeys[0]: an API key must not contain spaces (llama-swap refuses them)"]


def test_a_macro_name_of_64_characters_is_refused() -> None:
    name = "a" * 64
    errors = errors_of(f"macros: {{{name}: x}}\n" + MODEL)
    assert errors == [f"macros.{name}: macro names are 1-63 characters of letters, digits, _ and -"]
