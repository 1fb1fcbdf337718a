"""A config change without a restart: SIGHUP and `-watch-config`.

`ConfigSource` reads the config file again when asked (SIGHUP) or when it
changes on disk (`watch`: a stat poll, as llama-swap's `-watch-config` does).
A file that does not load is refused: its errors are logged and the running
config stays. One that loads is handed to `Scheduler.reload`, which asks the
core what the change does (`app.core.reload`), records it (`config_reloaded`)
and makes the one live `Config` the new one (`adopt`), so every reader (the
routes, the forwarder, the jobs) sees the old config or the new one whole,
never a mix: all of it happens in one synchronous stretch of the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Hashable, Mapping
from typing import Final

import msgspec

from app.config import Config, ConfigError, load_config
from app.config.commands import missing_programs
from app.core.reload import ReloadPlan

log = logging.getLogger("gpulane.reload")

NEEDS_RESTART: Final = ("database_path", "database_synchronous", "database_lease_s", "log_level")
"""Settings read once at start: a reload keeps them, and says so."""

WATCH_INTERVAL_S: Final = 2.0
"""How often `-watch-config` looks at the file (llama-swap polls too)."""


PROCESS_KEYS: Final = ("cmd", "cmdStop", "proxy", "env", "checkEndpoint", "peer")
"""The config keys a model's process is made of, in `process_identity`'s order."""


def process_identity(config: Config) -> dict[str, Hashable]:
    """Each model's process as it would be started (`PROCESS_KEYS`): a model
    whose identity changes at a reload is restarted once idle."""
    return {
        m.id: (m.cmd, m.cmd_stop, m.proxy, tuple(sorted(m.env.items())), m.check_endpoint, m.peer)
        for m in config.models.values()
    }


def reload_summary(
    plan: ReloadPlan, old: Mapping[str, Hashable], new: Mapping[str, Hashable]
) -> str:
    """What a reload did, for its log line: the models added, removed and to
    restart once idle, each restart with its reason (the keys that changed, or
    removed), and the changed models with no process to restart."""

    def why(model: str) -> str:
        if model not in new:
            return "removed"
        before, after = old.get(model), new[model]
        if not isinstance(before, tuple) or not isinstance(after, tuple):
            return "changed"
        keys = [k for k, a, b in zip(PROCESS_KEYS, before, after, strict=True) if a != b]
        return f"{', '.join(keys)} changed"

    def part(models: list[str], what: str, reasons: bool = False) -> str:
        named = ("; " if reasons else ", ").join(f"{m}: {why(m)}" if reasons else m for m in models)
        return f"{len(models)} {what}" + (f" ({named})" if models else "")

    parts = [
        part(plan.added, "added"),
        part(plan.removed, "removed"),
        part(plan.restarted, "to restart once idle", reasons=True),
    ]
    idle = sorted(m for m in new if m in old and old[m] != new[m] and m not in plan.restarted)
    if idle:
        parts.append(part(idle, "changed, not loaded", reasons=True))
    return ", ".join(parts)


def adopt(current: Config, new: Config) -> list[str]:
    """Make `current` (the object every part of the server holds) the new config,
    in place, but for the settings only a restart applies; their names, where
    they differ, are returned. `Config` is frozen for everyone else: this is the
    one place it changes."""
    kept = [f for f in NEEDS_RESTART if getattr(current, f) != getattr(new, f)]
    for field in current.__struct_fields__:
        if field not in NEEDS_RESTART:
            msgspec.structs.force_setattr(current, field, getattr(new, field))
    return kept


class ConfigSource:
    """The config file the server was started with, read again on demand."""

    def __init__(self, path: str, apply: Callable[[Config], object]) -> None:
        self.path = path
        self._apply = apply
        self._seen = self._stat()

    def reload(self) -> bool:
        """Read the file and apply it; False (logged) when it does not load."""
        self._seen = self._stat()
        try:
            config = load_config(self.path)
        except (ConfigError, OSError) as exc:
            log.error("reload of %s refused, the running config stays: %s", self.path, exc)
            return False
        for warning in config.warnings:
            log.warning("config: %s", warning)
        for model, why in missing_programs(config).items():
            log.warning("config: models.%s.cmd: %s", model, why)
        self._apply(config)
        return True

    async def watch(self, interval: float = WATCH_INTERVAL_S) -> None:
        """Reload whenever the file's size, time or inode changes (`-watch-config`)."""
        while True:
            await asyncio.sleep(interval)
            if self._stat() != self._seen:
                self.reload()

    def _stat(self) -> tuple[tuple[str, int, int, int], ...] | None:
        """What the poll compares: the file's, or each file's of a config directory."""
        try:
            if not os.path.isdir(self.path):
                st = os.stat(self.path)
                return (("", st.st_mtime_ns, st.st_size, st.st_ino),)
            seen = []
            for entry in sorted(os.scandir(self.path), key=lambda e: e.name):
                st = entry.stat()
                seen.append((entry.name, st.st_mtime_ns, st.st_size, st.st_ino))
            return tuple(seen)
        except OSError:
            return None
