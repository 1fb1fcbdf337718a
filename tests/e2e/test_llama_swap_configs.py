"""Every example config in llama-swap's repository loads (issue 24, item 1), checked
with `gpulane check-config` as a user runs it: exit 0, warnings allowed, and every
model of the file there, resolved (issue 33's weak test).

The files are copies (tests/fixtures/llama-swap/README.md says from where, and
what was mended: only what llama-swap itself refuses)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.gateway import REPO, Gateway

FIXTURES = REPO / "tests" / "fixtures" / "llama-swap"
# The variables the examples read as ${env.NAME}; llama-swap needs them set too.
ENVIRONMENT = {"API_KEY_1": "sk-one", "API_KEY_2": "sk-two", "OPENROUTER_API_KEY": "sk-or"}


def gpulane() -> list[str]:
    script = Path(sys.executable).with_name("gpulane")
    return [str(script)] if script.exists() else [sys.executable, "-m", "app.cli"]


def test_every_example_is_vendored() -> None:
    readme = (FIXTURES / "README.md").read_text()
    for example in sorted(FIXTURES.glob("*.yaml")):
        assert f"`{example.name}`" in readme, f"{example.name} has no source in README.md"


# What each example resolves to: every model by name, and for the local ones the
# program the cmd runs and the proxy it is reached at, so a loader that drops or
# mangles a model fails here (checking the exit status alone would not).
OPENROUTER = "https://openrouter.ai/api"
PEER = "http://192.168.1.23"
EXPECTED: dict[str, dict[str, tuple[str | None, str]]] = {
    "config.example.yaml": {
        "docker-llama": ("docker", "http://127.0.0.1:10001"),
        "gpt-oss-120b": ("/path/to/llama-server/llama-server-ec9e0301", "http://127.0.0.1:8999"),
        "unlisted-model": ("some-upstream-server", "http://localhost:10003"),
        "llama-swap-peer/embeddings/model_c": (None, PEER),
        "llama-swap-peer/model_a": (None, PEER),
        "llama-swap-peer/model_b": (None, PEER),
        "openrouter/deepseek/deepseek-v3.2": (None, OPENROUTER),
        "openrouter/meta-llama/llama-3.1-8b-instruct": (None, OPENROUTER),
        "openrouter/minimax/minimax-m2.1": (None, OPENROUTER),
        "openrouter/moonshotai/kimi-k2-0905": (None, OPENROUTER),
        "openrouter/qwen/qwen3-235b-a22b-2507": (None, OPENROUTER),
        "openrouter/z-ai/glm-4.7": (None, OPENROUTER),
    },
    "docker-config.example.yaml": {
        "qwen2.5": ("/app/llama-server", "http://127.0.0.1:9999"),
        "smollm2": ("/app/llama-server", "http://127.0.0.1:9999"),
        "z-image": ("/app/sd-server", "http://127.0.0.1:9999"),
    },
    "docker-unified-config.example.yaml": {
        "audio": ("audiocpp_server", "http://localhost:5800"),
        "image": ("/app/sd-server", "http://127.0.0.1:9999"),
        "llama": ("llama-server", "http://localhost:5801"),
        "whisper": ("whisper-server", "http://localhost:5802"),
    },
    "docs-examples-aider-qwq-coder-llama-swap.yaml": {
        "QwQ": ("/path/to/llama-server", "http://127.0.0.1:9503"),
        "qwen-coder-32B": ("/path/to/llama-server", "http://127.0.0.1:8999"),
    },
}


def test_every_example_has_its_expected_models() -> None:
    assert sorted(EXPECTED) == sorted(p.name for p in FIXTURES.glob("*.yaml"))


@pytest.mark.parametrize("example", sorted(p.name for p in FIXTURES.glob("*.yaml")))
def test_llama_swap_example_config_loads(example: str, tmp_path: Path) -> None:
    env = os.environ | ENVIRONMENT | {"PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [*gpulane(), "check-config", "--format", "json", str(FIXTURES / example)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    # Whatever gpulane does not do is said, not silently dropped.
    for line in done.stderr.splitlines():
        assert line.startswith("warning: "), line
    printed = json.loads(done.stdout)  # as the file spells it: a peer's models are its own
    resolved: dict[str, tuple[str | None, str]] = {
        name: (shlex.split(spec["cmd"])[0], spec["proxy"])
        for name, spec in printed["models"].items()
    }
    for peer, spec in printed.get("peers", {}).items():
        resolved |= {f"{peer}/{model}": (None, spec["proxy"]) for model in spec["models"]}
    assert resolved == EXPECTED[example]


def test_group_members_naming_no_model_load_with_a_warning_naming_each() -> None:
    # llama-swap's loader only checks members for duplicates, and its own example
    # names models it does not define.
    env = os.environ | ENVIRONMENT | {"PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [*gpulane(), "check-config", str(FIXTURES / "config.example.yaml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    groups = "routing.router.settings.groups"
    for at, member in [
        ("group1.members[0]", "llama"),
        ("group2.members[1]", "modelA"),
        ("forever.members[2]", "forever-modelc"),
    ]:
        assert f"warning: {groups}.{at}: unknown model {member!r}, not a member" in done.stderr


def test_a_config_with_no_models_serves_and_answers_404(tmp_path: Path) -> None:
    # llama-swap loads such a config; gpulane starts, lists nothing, and says so.
    gateway = Gateway(tmp_path, "logLevel: INFO\n").start()
    try:
        assert httpx.get(gateway.url + "/v1/models").json()["data"] == []
        answer = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert answer.status_code == 404, answer.text
    finally:
        gateway.stop()
