"""`gpulane check-config FILE`: validate a config and show what it resolves to."""

from __future__ import annotations

import sys
from typing import TextIO

import msgspec
import yaml

from app.config.loading import ConfigError, load_config
from app.config.resolved import masked

EXIT_OK = 0
EXIT_INVALID = 2


def check_config_command(
    path: str,
    *,
    output_format: str = "yaml",
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
    data = masked(config)
    data.pop("warnings", None)  # already on stderr; stdout stays the config alone
    if output_format == "json":
        out.write(msgspec.json.format(msgspec.json.encode(data), indent=2).decode() + "\n")
    else:
        out.write(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    return EXIT_OK
