"""What-if resources: the router and serial slots of a `--config` file, which the
replay (`--config`) and its check against ground truth (`truth --config`) run
every parameter set on again."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from app.core.residency import Router
from app.core.state import SERIAL


class ResourcesError(Exception):
    """A `--config` that cannot be simulated, with a sentence saying why."""


@dataclass(frozen=True, slots=True)
class Resources:
    """The router and slots of a `--config` file: the what-if resources."""

    label: str
    router: Router | None
    slots: tuple[tuple[str, int], ...]


def load_resources(path: str, models: Sequence[str]) -> Resources:
    """The router and serial slots of the config at `path`; every model of the
    workload must be one of its models (resolved ids)."""
    from app.config.loading import ConfigError, load_config

    try:
        config = load_config(path)
    except ConfigError as exc:
        raise ResourcesError(f"--config {path}: {exc}") from exc
    missing = sorted(set(models) - set(config.models))
    if missing:
        raise ResourcesError(
            f"--config {path}: the log's models {', '.join(missing)} are not in it "
            f"(it has {', '.join(sorted(config.models)) or 'none'})"
        )
    slots = tuple(
        sorted(
            (m.id, m.concurrency_limit) for m in config.models.values() if m.concurrency_limit > 1
        )
    )
    if config.scheduler != SERIAL:
        slots = ()  # fifo's limits are not serial slots; the score's sets run serial
    return Resources(Path(path).name, config.router, slots)
