"""A model's `sleep` key and `sleepHostMemory` (issue 43): presets as the servers
spell their endpoints, custom calls, and named errors for what is wrong."""

from __future__ import annotations

import pytest
import yaml

from app.config import ConfigError, parse_config
from app.config.file_form import file_form
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
        (
            "vlm",
            "models.m.sleep.preset: 'vlm' is not a sleep preset; "
            "expected one of vllm, sglang, comfyui",
        ),
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


def comfy(sleep: str, kind: str = "kind: comfyui", model_id: str = "c") -> str:
    return (
        f"models:\n  {model_id}:\n    cmd: comfy --port ${{PORT}}\n    {kind}\n    sleep: {sleep}\n"
    )


def test_comfyui_frees_memory_by_post_free_and_wakes_at_its_next_prompt() -> None:
    """ComfyUI's `/free` (its server.py) with the flags its manager's "Free model
    and node cache" sends; no wake call exists: a health read, then the prompt."""
    spec = parse_config(comfy("comfyui"), environ={}).models["c"].sleep
    assert spec is not None and spec.preset == "comfyui"
    assert spec.sleep == (HttpCall("POST", "/free", {"unload_models": True, "free_memory": True}),)
    assert spec.idle == HttpCall("GET", "/queue")  # freed between prompts: wait for idle
    assert spec.wake == (HttpCall("GET", "/system_stats"),)
    assert spec.check is None and spec.level is None and spec.host_memory == 0


def test_comfyui_auto_is_a_comfyui_server_and_takes_the_preset_with_bounds() -> None:
    text = comfy("{preset: comfyui, timeout: 30, wakeTimeout: 5}", kind="", model_id="comfyui_auto")
    config = parse_config(text, environ={})
    spec = config.models["comfyui_auto"].sleep
    assert spec is not None and spec.preset == "comfyui"
    assert (spec.sleep_timeout, spec.wake_timeout) == (30, 5)
    # The file form names the preset and loads back as the same sleep.
    again = parse_config(yaml.safe_dump(file_form(config)), environ={})
    assert again.models["comfyui_auto"].sleep == spec


def test_a_comfyui_server_may_still_sleep_by_calls_of_its_own() -> None:
    """A custom node may offer its own endpoints: custom calls are any server's."""
    text = comfy('{sleep: "POST /offload", wake: "POST /reload"}')
    spec = parse_config(text, environ={}).models["c"].sleep
    assert spec is not None and spec.preset == "custom" and spec.idle is None


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            model("comfyui"),
            "models.m.sleep.preset: 'comfyui' is ComfyUI's sleep (POST /free): it needs kind: "
            "comfyui; for a model without kind use vllm or sglang, or give sleep/wake/check calls",
        ),
        (
            comfy("comfyui", kind="kind: openai-videos"),
            "models.c.sleep.preset: 'comfyui' is ComfyUI's sleep (POST /free): it needs kind: "
            "comfyui; for kind 'openai-videos' use vllm or sglang",
        ),
        (
            comfy("vllm"),
            "models.c.sleep.preset: 'vllm' is not a ComfyUI server's sleep; with kind: comfyui "
            "use comfyui (POST /free), or give sleep/wake/check calls",
        ),
        (
            comfy("{preset: sglang}", kind="", model_id="comfyui_auto"),
            "models.comfyui_auto.sleep.preset: 'sglang' is not a ComfyUI server's sleep",
        ),
        (comfy("{preset: comfyui, level: 2}"), "models.c.sleep.level: only preset vllm has"),
        (comfy("{preset: comfyui, wake: 'POST /x'}"), "models.c.sleep.wake: is set by preset"),
    ],
    ids=["no-kind", "videos", "vllm-on-comfyui", "sglang-on-comfyui_auto", "level", "wake"],
)
def test_the_comfyui_preset_is_for_comfyui_servers_only(text: str, error: str) -> None:
    found = errors_of(text)
    assert any(e.startswith(error) for e in found), found
