"""What-if resources: the router and serial slots of a `--config` file, which the
replay (`--config`) and its check against ground truth (`truth --config`) run
every parameter set on again; or the memory router with a budget
(`--memory-budget`), sized by the footprints the log recorded."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from app.config.checks import Issues
from app.config.memory_size import parse_mib
from app.core.residency import MemoryRouter, Router
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


def memory_resources(
    budget: str, footprints: Mapping[str, int], recorded: Router | None, models: Sequence[str]
) -> Resources:
    """`--memory-budget`: the memory router with this budget (a size: `141GB`),
    sizes from the log (`footprints`, measured) or the recorded memory router's
    declared ones; a model of neither size loads alone, as the router does."""
    issues = Issues()
    budget_mib = parse_mib(issues, budget, "--memory-budget")
    if budget_mib is None:
        raise ResourcesError(issues.errors[0])
    declared = dict(recorded.declared_mib) if isinstance(recorded, MemoryRouter) else {}
    known = {**declared, **footprints}
    unknown = sorted(set(models) - known.keys())
    label = f"memory {budget}"
    if unknown:
        label += f" ({len(unknown)} of unknown size)"
    router = MemoryRouter(
        budget_mib=budget_mib,
        declared_mib=dict(sorted(declared.items())),
        measured_mib=dict(sorted(footprints.items())),
    )
    return Resources(label, router, ())


def log_footprints(path: str) -> dict[str, int]:
    """Each model's footprint as the log at `path` last measured it."""
    from app.store.engine import open_readonly
    from app.store.footprints import recent_footprints

    engine = open_readonly(path)
    try:
        return recent_footprints(engine)
    finally:
        engine.dispose()
