"""docs/renders.md's config loads as pasted, and means what the page says."""

from __future__ import annotations

import re
from pathlib import Path

from app.config import parse_config
from app.runtime.parameters import server_started

DOC = Path(__file__).resolve().parents[2] / "docs" / "renders.md"


def test_the_pasted_config_loads_with_comfyui_as_a_held_render_server() -> None:
    block = re.search(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None
    config = parse_config(block.group(1))
    comfy = config.models["comfyui_auto"]
    assert (comfy.kind, comfy.check_endpoint, comfy.max_run_time) == (
        "comfyui",
        "/system_stats",
        3600,
    )
    assert comfy.output_dir == "/opt/ComfyUI/output"
    assert comfy.sleep is not None and comfy.sleep.preset == "comfyui"
    assert config.models["qwen"].kind is None
    assert server_started(config, 0, 0).held == ["comfyui_auto"]


def test_a_kind_gpulane_does_not_know_is_an_error_naming_the_allowed_ones() -> None:
    text = "models:\n  m:\n    cmd: server --port ${PORT}\n    kind: comfy\n"
    try:
        parse_config(text)
    except Exception as exc:
        assert "models.m.kind" in str(exc) and "comfyui" in str(exc), str(exc)
    else:
        raise AssertionError("kind: comfy was accepted")


def test_output_dir_belongs_to_a_comfyui_model() -> None:
    text = "models:\n  m:\n    cmd: server --port ${PORT}\n    outputDir: /tmp/out\n"
    try:
        parse_config(text)
    except Exception as exc:
        assert "models.m.outputDir" in str(exc) and "kind: comfyui" in str(exc), str(exc)
    else:
        raise AssertionError("outputDir without kind comfyui was accepted")
