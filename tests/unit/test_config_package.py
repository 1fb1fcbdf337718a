"""The config package: its public names, and defaults that mean what the core does."""

from __future__ import annotations

import subprocess
import sys

import pytest

import app.config
from app.config import ConfigError, parse_config
from app.core.scoring import ScoringParams
from app.core.state import SCHEDULERS, SERIAL_CONCURRENCY_LIMIT, SchedulerState

ONE_MODEL = "models:\n  m:\n    cmd: server --port ${PORT}\n"


def with_scheduler(name: str) -> str:
    return ONE_MODEL + f"routing:\n  scheduler:\n    use: {name}\n"


def test_the_package_exports_only_what_callers_use() -> None:
    assert sorted(app.config.__all__) == [
        "Config",
        "ConfigError",
        "ModelConfig",
        "load_config",
        "parse_config",
    ]
    for name in app.config.__all__:
        assert getattr(app.config, name) is not None


def test_an_empty_config_scores_as_the_core_does_when_the_log_is_silent() -> None:
    # Replay and explain fall back to ScoringParams() for logs that predate
    # the scoring fields; a default config must have made the same decisions.
    config = parse_config(ONE_MODEL)
    assert ScoringParams(config.aging_divisor_ns, config.swap_affinity_bonus) == ScoringParams()
    assert config.aging_divisor == ScoringParams().aging_divisor_ns / 1e9
    assert isinstance(config.aging_divisor, float)  # shown and hashed as 60.0
    assert config.models["m"].concurrency_limit == SERIAL_CONCURRENCY_LIMIT


@pytest.mark.parametrize("name", SCHEDULERS)
def test_every_scheduler_the_config_accepts_runs_in_the_core(name: str) -> None:
    config = parse_config(with_scheduler(name))
    state = SchedulerState(ScoringParams(), scheduler=config.scheduler)
    assert state.scheduler == name


def test_an_unknown_scheduler_is_refused_naming_the_cores_schedulers() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(with_scheduler("lifo"))
    assert caught.value.errors == [
        f"routing.scheduler.use: 'lifo' is not allowed; expected one of {', '.join(SCHEDULERS)}"
    ]
    with pytest.raises(ValueError):
        SchedulerState(ScoringParams(), scheduler="lifo")


def test_the_core_imports_no_config() -> None:
    # app/core is pure and owns the shared names; the config imports it, never
    # the reverse. A fresh interpreter, so other tests' imports do not count.
    code = (
        "import pkgutil, importlib, sys, app.core\n"
        "for m in pkgutil.iter_modules(app.core.__path__):\n"
        "    importlib.import_module('app.core.' + m.name)\n"
        "print(sorted(n for n in sys.modules if n.startswith('app.config')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"
