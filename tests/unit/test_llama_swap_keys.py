"""llama-swap keys its schema leaves out but its Go structs read (issue 24, item 1):
each loads, and works or warns."""

from __future__ import annotations

from app.config import parse_config

MODEL = "models:\n  m:\n    cmd: server --port ${PORT}\n"


def test_older_strip_params_spelling_strips() -> None:
    config = parse_config(MODEL + "    filters:\n      strip_params: 'top_k, temperature'\n")
    assert config.models["m"].strip_params == ("top_k", "temperature")
    assert config.warnings == ()


def test_strip_params_spelled_both_ways_takes_the_current_one() -> None:
    both = "    filters:\n      stripParams: top_p\n      strip_params: top_k\n"
    assert parse_config(MODEL + both).models["m"].strip_params == ("top_p",)


def test_log_requests_is_honoured_and_a_models_health_check_timeout_warns() -> None:
    config = parse_config("logRequests: true\n" + MODEL + "    healthCheckTimeout: 30\n")
    assert config.log_requests is True  # app/web/access_log.py; tests/e2e/test_access_log.py
    assert parse_config(MODEL).log_requests is False
    assert [w.split(":")[0] for w in config.warnings] == ["models.m.healthCheckTimeout"]
    assert "the top-level healthCheckTimeout applies" in config.warnings[0]


def test_peers_load_and_serve_their_models() -> None:
    peers = "peers:\n  box2:\n    proxy: http://box2:8080\n    models: [a]\n"
    config = parse_config(MODEL + peers)
    assert config.warnings == ()
    assert config.resolve_model("box2/a") == "box2/a" == config.resolve_model("a")
