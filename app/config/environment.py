"""The environment a config's `${env.NAME}` reads: the process's, and one default.

`GPULANE_CACHE` is where `make llama` (tools/fetch_llama.py) builds llama-server
and puts the test model, and config.example.yaml names both through
`${env.GPULANE_CACHE}`. Unset (or empty), it is `~/.cache/gpulane`: decided
here, for the build and every config alike, so `make run` serves the files it
built wherever the cache is.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Final

CACHE_VARIABLE: Final = "GPULANE_CACHE"


def cache_root(environ: Mapping[str, str]) -> Path:
    """The llama.cpp build's cache in `environ`: `GPULANE_CACHE` (a leading `~`
    is the home directory), else `~/.cache/gpulane`."""
    value = environ.get(CACHE_VARIABLE)
    home = environ.get("HOME") or str(Path.home())
    if not value:
        return Path(home) / ".cache" / "gpulane"
    if value == "~" or value.startswith("~/"):
        return Path(home + value[1:])
    return Path(value)


def config_environ(environ: Mapping[str, str]) -> Mapping[str, str]:
    """`environ` as a config's `${env.NAME}` sees it: `GPULANE_CACHE` always set."""
    return {**environ, CACHE_VARIABLE: str(cache_root(environ))}
