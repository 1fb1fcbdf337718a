"""A model's `sleep` key and `sleepHostMemory` (issue 43): presets as the servers
spell their endpoints, custom calls, and named errors for what is wrong."""

from __future__ import annotations

import pytest

from app.config import ConfigError, parse_config
from app.config.sleep import HttpCall


def model(sleep: str) -> str:
    return f"models:\n  m:\n    cmd: srv --port ${{PORT}}\n    sleep: {sleep}\n"


def errors_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, environ={})
    return caught.value.errors


def test_vllm_level_1_is_the_default_and_checks_is_sleeping() -> None:
    spec = parse_config(model("vllm"), environ={}).models["m"].sleep
    assert spec is not None
    assert spec.sleep == (HttpCall("POST", "/sleep?level=1"),)
    assert spec.wake == (HttpCall("POST", "/wake_up"),)
    assert spec.check == HttpCall("GET", "/is_sleeping")


def test_vllm_level_2_wakes_the_weights_reloads_them_then_the_kv_cache() -> None:
    spec = parse_config(model("{preset: vllm, level: 2, hostMemory: 1GiB}"), environ={})
    sleep = spec.models["m"].sleep
    assert sleep is not None and sleep.host_memory == 1 << 30
    assert sleep.sleep == (HttpCall("POST", "/sleep?level=2"),)
    assert [str(c) for c in sleep.wake] == [
        "POST /wake_up?tags=weights",
        "POST /collective_rpc",
        "POST /wake_up?tags=kv_cache",
    ]
    assert sleep.wake[1].body == {"method": "reload_weights"}


def test_sglang_releases_and_resumes_memory_occupation() -> None:
    spec = parse_config(model("sglang"), environ={}).models["m"].sleep
    assert spec is not None and spec.check is None
    assert spec.sleep == (HttpCall("POST", "/release_memory_occupation", {}),)
    assert spec.wake == (HttpCall("POST", "/resume_memory_occupation", {}),)


def test_custom_calls_for_any_server_and_a_budget() -> None:
    text = "sleepHostMemory: 100GB\n" + model(
        '{sleep: "POST /off", wake: "post /on", check: "GET /state", wakeTimeout: 5}'
    )
    config = parse_config(text, environ={})
    spec = config.models["m"].sleep
    assert config.sleep_host_memory == 100 * 10**9
    assert spec is not None and spec.preset == "custom" and spec.wake_timeout == 5
    assert (spec.sleep, spec.wake, spec.check) == (
        (HttpCall("POST", "/off"),),
        (HttpCall("POST", "/on"),),
        HttpCall("GET", "/state"),
    )


def test_a_model_without_sleep_is_stopped_as_before() -> None:
    assert parse_config(model("null"), environ={}).models["m"].sleep is None


@pytest.mark.parametrize(
    ("sleep", "error"),
    [
        ("vlm", "models.m.sleep.preset: 'vlm' is not a sleep preset; expected one of vllm, sglang"),
        ("{preset: vllm, level: 3}", "models.m.sleep.level: 3 is not a vLLM sleep level"),
        ("{preset: sglang, level: 2}", "models.m.sleep.level: only preset vllm has sleep levels"),
        ("{preset: vllm, wake: 'POST /x'}", "models.m.sleep.wake: is set by preset 'vllm'"),
        ("{sleep: 'POST /x'}", "models.m.sleep.wake: missing: a custom sleep needs"),
        ("{sleep: 'SLEEP', wake: 'POST /w'}", "models.m.sleep.sleep: 'SLEEP' is not 'METHOD"),
        ("{sleep: 'POST x', wake: 'POST /w'}", "models.m.sleep.sleep: 'x' must be a path"),
        ("{sleep: 'DROP /x', wake: 'POST /w'}", "models.m.sleep.sleep: 'DROP' is not a method"),
        ("{preset: vllm, wakeTimout: 3}", "models.m.sleep.wakeTimout: unknown key; did you mean"),
        ("{preset: vllm, hostMemory: lots}", "models.m.sleep.hostMemory: 'lots' is not a size"),
        ("{preset: vllm, timeout: 0}", "models.m.sleep.timeout: 0 is out of range"),
        ("[vllm]", "models.m.sleep: expected a string or a mapping"),
    ],
)
def test_a_bad_sleep_names_the_key_the_value_and_what_is_allowed(sleep: str, error: str) -> None:
    found = errors_of(model(sleep))
    assert any(e.startswith(error) for e in found), found


def test_a_bad_budget_is_named() -> None:
    found = errors_of("sleepHostMemory: -1\n" + model("vllm"))
    assert any(e.startswith("sleepHostMemory: -1 is not a size") for e in found), found
