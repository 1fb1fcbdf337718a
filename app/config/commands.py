"""`gpulane check-config FILE`: validate a config and say what matters in it.

The default output is a summary for a person: an ok line, each model with the
program it starts (and whether that program is there: a typo in a binary's
path loads as config but fails the first request), the router, the score's
terms and the database. `--format yaml|json` prints the whole resolved config
as its file would spell it (`file_form`): it loads back as the same config.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import TextIO

import msgspec
import yaml

from app.config.file_form import file_form
from app.config.loading import ConfigError, load_config
from app.config.resolved import Config, ModelConfig
from app.core.residency import describe

EXIT_OK = 0
EXIT_INVALID = 2


def check_config_command(
    path: str,
    *,
    output_format: str = "summary",
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Print the resolved config (API keys masked) and warnings; 2 on errors."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    try:
        config = load_config(path)
    except ConfigError as exc:
        count = len(exc.errors)
        print(f"{path}: {count} config error{'s' if count != 1 else ''}:", file=err)
        for message in exc.errors:
            print(f"  {message}", file=err)
        return EXIT_INVALID
    for warning in config.warnings:
        print(f"warning: {warning}", file=err)
    missing = missing_programs(config)
    for model, why in missing.items():
        print(f"warning: models.{model}.cmd: {why}", file=err)
    if output_format == "summary":
        out.write(summary(path, config, missing))
        return EXIT_OK
    data = file_form(config)  # warnings are on stderr; stdout is the config alone
    if output_format == "json":
        out.write(msgspec.json.format(msgspec.json.encode(data), indent=2).decode() + "\n")
    else:
        # One line per value, however long (a cmd), as a person would write it.
        out.write(yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=1 << 20))
    return EXIT_OK


def missing_programs(config: Config) -> dict[str, str]:
    """Model id -> why its program cannot be started, for each such model:
    what check-config, `gpulane serve` and a reload warn about."""
    return {m.id: why for m in config.models.values() if (why := missing_program(m))}


def missing_program(model: ModelConfig) -> str | None:
    """Why `model`'s program cannot be started, or None: a peer's model and a
    program found (as a path, or on PATH) are fine."""
    if model.peer is not None or not model.cmd:
        return None
    program = model.cmd[0]
    if os.sep in program:
        if os.path.isfile(program) and os.access(program, os.X_OK):
            return None
        return (
            f"program {program!r} is not an executable file: the first request for "
            f"{model.id!r} will fail to start it (502)"
        )
    if shutil.which(program) is not None:
        return None
    return (
        f"program {program!r} is not found on PATH: the first request for "
        f"{model.id!r} will fail to start it (502)"
    )


def summary(path: str, config: Config, missing: dict[str, str]) -> str:
    """What a person checks: the models, what they start, the policy, the database."""
    count = len(config.models)
    problems = len(config.warnings) + len(missing)
    lines = [
        f"{path}: ok, {count} model{'s' if count != 1 else ''}"
        + (f", {problems} warning{'s' if problems != 1 else ''} (above)" if problems else "")
    ]
    width = max((len(m) for m in config.models), default=0)
    for model in config.models.values():
        if model.peer is not None:
            start = f"peer {model.peer} at {model.proxy}"
        else:
            program = model.cmd[0] if model.cmd else "(no cmd)"
            start = f"{program}{' (NOT FOUND)' if model.id in missing else ''} -> {model.proxy}"
        extra = [f"aliases {', '.join(model.aliases)}"] if model.aliases else []
        extra.append(f"ttl {model.ttl:g} s" if model.ttl else "no ttl")
        extra.append(f"{model.concurrency_limit} slot{'s' if model.concurrency_limit != 1 else ''}")
        if model.sleep is not None:
            level = f" level {model.sleep.level}" if model.sleep.level else ""
            extra.append(f"sleeps: {model.sleep.preset}{level}")
        lines.append(f"  {model.id:<{width}}  {start}  ({'; '.join(extra)})")
    lines.append(f"router: {describe(config.router)}")
    aging = f"{config.aging_divisor:g} s per point" if config.aging_divisor else "off"
    lines.append(
        f"scheduler: {config.scheduler}; swap affinity +{config.swap_affinity_bonus}, "
        f"fair share up to +{config.fair_share_bonus}, short jobs up to "
        f"+{config.short_job_bonus}, aging {aging}"
    )
    keys = len(config.api_keys)
    lines.append(
        f"callers: {keys} API key{'s' if keys != 1 else ''}"
        if keys
        else "callers: no apiKeys (anyone may call; X-Gpulane-Caller names a caller)"
    )
    lines.append(f"database: {config.database_path}")
    lines.append("the whole resolved config: --format yaml (or json)")
    return "\n".join(lines) + "\n"
