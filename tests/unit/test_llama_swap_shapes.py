"""llama-swap's filters.setParamsByID, includeAliasesInList, its path rewriting
and ids in paths (issue 24, item 3); the routes themselves are tested end to
end in tests/e2e/test_llama_swap_routes.py."""

from __future__ import annotations

import textwrap

import pytest

from app.config import Config, ConfigError, parse_config
from app.web.model_routes import forwarded_path, model_in_path
from app.web.request_body import BadRequest, query_model, rewrite


def config(text: str) -> Config:
    return parse_config(textwrap.dedent(text), environ={})


BY_ID = """
    includeAliasesInList: true
    models:
      m:
        cmd: server --port ${PORT}
        aliases: [mini]
        filters:
          setParams: {top_k: 5}
          setParamsByID:
            "${MODEL_ID}:high": {reasoning_effort: high, model: other}
            "m": {top_k: 1}
            "mini": {top_k: 2}
"""


def test_set_params_by_id_keys_are_aliases_with_macros_expanded() -> None:
    c = config(BY_ID)
    spec = c.models["m"]
    assert c.include_aliases_in_list is True
    # The model's own id is no alias of itself; an explicit alias is not repeated.
    assert spec.aliases == ("mini", "m:high")
    assert c.resolve_model("m:high") == "m"
    assert spec.set_params_by_id == {
        "m:high": {"reasoning_effort": "high"},
        "m": {"top_k": 1},
        "mini": {"top_k": 2},
    }
    assert any("setParamsByID.${MODEL_ID}:high.model" in w for w in c.warnings)
    assert not any("ignored" in w and "includeAliasesInList" in w for w in c.warnings)


def test_a_set_params_by_id_key_naming_another_model_is_an_error() -> None:
    text = BY_ID.replace('"m": {top_k: 1}', '"n": {top_k: 1}') + (
        "      n:\n        cmd: server --port ${PORT}\n"
    )
    with pytest.raises(ConfigError, match="'n' is also a model id"):
        config(text)


def test_defaults_leave_the_config_hash_as_before() -> None:
    plain = config("models:\n  m:\n    cmd: server --port ${PORT}\n")
    assert plain.include_aliases_in_list is False and plain.models["m"].set_params_by_id == {}
    listed = config("includeAliasesInList: true\nmodels:\n  m:\n    cmd: server --port ${PORT}\n")
    assert listed.config_hash != plain.config_hash


def test_rewrite_sets_the_requested_ids_params_after_set_params() -> None:
    spec = config(BY_ID).models["m"]
    assert rewrite({"model": "m:high", "top_k": 9}, spec, "m:high") == {
        "model": "m:high",
        "top_k": 5,
        "reasoning_effort": "high",
    }
    assert rewrite({"model": "m"}, spec, "m") == {"model": "m", "top_k": 1}
    assert rewrite({"model": "mini", "top_k": 2}, spec, "mini") is None  # unchanged


def test_paths_reach_the_upstream_as_llama_swap_sends_them() -> None:
    assert forwarded_path("/v/chat/completions") == "/chat/completions"
    assert forwarded_path("/v/messages/count_tokens") == "/messages/count_tokens"
    assert forwarded_path("/audioapi/v1/tasks/run") == "/v1/tasks/run"
    assert forwarded_path("/sdapi/v1/txt2img") == "/sdapi/v1/txt2img"
    assert forwarded_path("/v1/chat/completions") == "/v1/chat/completions"


def test_the_longest_configured_id_in_a_path_wins() -> None:
    names = {"org/model": "org/model", "org/model/v2": "org/model/v2", "a": "a", "al": "a"}
    assert model_in_path(names, "org/model/v2/x%2Fy") == ("org/model/v2", "org/model/v2", "/x%2Fy")
    assert model_in_path(names, "org/model/health") == ("org/model", "org/model", "/health")
    assert model_in_path(names, "org%2Fmodel/health") == ("org/model", "org/model", "/health")
    assert model_in_path(names, "al") == ("al", "a", "/")
    assert model_in_path(names, "org/nothing") is None
    assert model_in_path(names, "") is None


def test_query_model() -> None:
    assert query_model(b"model=org%2Fmodel&x=1") == "org/model"
    for query in (b"", b"model=", b"x=1"):
        with pytest.raises(BadRequest) as err:
            query_model(query)
        assert err.value.code == "missing_model"
