"""`make bench-gpu` (bench/gpu_bench.py): without a GPU it says so and exits 0; the
configs of its arms are configs gpulane loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.config import parse_config
from bench import gpu_bench


def test_without_a_gpu_it_says_so_and_exits_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gpu_bench, "gpu", lambda: None)
    assert gpu_bench.main([]) == 0
    assert "no NVIDIA GPU with PyTorch here" in capsys.readouterr().out


@pytest.mark.parametrize("arm", ["score", "arrival", "sleep"])
def test_each_arms_config_loads(arm: str) -> None:
    text = gpu_bench.config(arm, "bench/gpu_upstream.py", Path("/tmp/x.jsonl"), 21000, 56, False)
    config = parse_config(text, environ={})
    assert set(config.models) == {gpu_bench.A, gpu_bench.B}
    assert (config.models[gpu_bench.A].sleep is not None) == (arm == "sleep")
    assert config.swap_affinity_bonus == (0 if arm == "arrival" else 10)
    assert config.aging_divisor == (0 if arm == "arrival" else 60)
    assert config.warnings == ()


def test_the_memory_arm_runs_the_memory_router() -> None:
    assert gpu_bench.memory_router_present(56)
    text = gpu_bench.config("memory", "x.py", Path("/tmp/x.jsonl"), 21000, 1, True)
    config = parse_config(text, environ={})
    assert type(config.router).__name__ == "MemoryRouter"
    assert config.models[gpu_bench.A].gpu_memory_mib == 1024
