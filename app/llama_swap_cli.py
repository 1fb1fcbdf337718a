"""llama-swap's command line, read by `gpulane` so a service unit can swap the
binary and nothing else: `gpulane -config /etc/llama-swap.yaml -listen :8080`
is `gpulane serve --config /etc/llama-swap.yaml --listen 0.0.0.0:8080`.

llama-swap parses its flags with Go's `flag` package: `-name` or `--name`,
`-name value` or `-name=value`, a boolean as `-name` or `-name=true|false`,
parsing stops at `--` or the first argument that is not a flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from app import __version__

Handling = Literal["maps", "warns", "refuses"]


@dataclass(frozen=True)
class LlamaSwapFlag:
    takes_value: bool
    handling: Handling
    does: str
    """What gpulane does with the flag, or why it refuses it."""


# Every flag of llama-swap's main (llama-swap.go), and what gpulane does with it.
LLAMA_SWAP_FLAGS: Final[dict[str, LlamaSwapFlag]] = {
    "config": LlamaSwapFlag(True, "maps", "the config file, as `serve --config FILE`"),
    "config-dir": LlamaSwapFlag(
        True,
        "maps",
        "a directory whose *.yml/*.yaml files merge as llama-swap merges them, as "
        "`serve --config DIR`; not together with -config (gpulane reads one config path)",
    ),
    "listen": LlamaSwapFlag(
        True,
        "maps",
        "`serve --listen`; `:PORT` is every interface (0.0.0.0:PORT); "
        "unset is :8080, or :8443 with TLS, as in llama-swap",
    ),
    "tls-cert-file": LlamaSwapFlag(True, "maps", "`serve --tls-cert-file`: serve HTTPS"),
    "tls-key-file": LlamaSwapFlag(True, "maps", "`serve --tls-key-file`: serve HTTPS"),
    "version": LlamaSwapFlag(False, "maps", "prints gpulane's version and exits"),
    "watch-config": LlamaSwapFlag(
        False,
        "maps",
        "`serve --watch-config`: reload the config when the file changes (SIGHUP "
        "reloads it too), keeping the queue",
    ),
}
_HELP: Final = frozenset({"h", "help"})
_TRUE: Final = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_FALSE: Final = frozenset({"0", "f", "F", "FALSE", "false", "False"})


class FlagError(Exception):
    """A llama-swap command line gpulane cannot run; the message names the flag."""


@dataclass(frozen=True)
class Translated:
    """What a llama-swap command line asks for: gpulane arguments to run, or
    text to print and exit 0 with."""

    argv: list[str]
    print_and_exit: str | None = None
    warnings: tuple[str, ...] = ()


def is_llama_swap_command_line(argv: list[str]) -> bool:
    """gpulane's own command lines start with a command (or -h/--help); any
    other leading dash is llama-swap's Go-style flags."""
    return bool(argv) and argv[0].startswith("-") and argv[0] not in ("-h", "--help")


def usage() -> str:
    lines = ["llama-swap's flags, read as `gpulane serve`:"]
    for name, flag in LLAMA_SWAP_FLAGS.items():
        value = " VALUE" if flag.takes_value else ""
        lines.append(f"  -{name}{value}: {flag.handling}: {flag.does}")
    return "\n".join(lines)


def translate(argv: list[str]) -> Translated:
    """The `gpulane serve` arguments a llama-swap command line means."""
    given: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":
            break
        if not arg.startswith("-") or arg == "-":
            i -= 1
            break
        name, eq, value = arg.lstrip("-").partition("=")
        if name in _HELP:
            return Translated([], print_and_exit=usage())
        flag = LLAMA_SWAP_FLAGS.get(name)
        if flag is None:
            raise FlagError(
                f"flag provided but not defined: -{name} (llama-swap's flags are "
                f"{', '.join('-' + n for n in LLAMA_SWAP_FLAGS)}; gpulane's own commands: "
                "gpulane --help)"
            )
        if flag.takes_value:
            if not eq:
                if i >= len(argv):
                    raise FlagError(f"flag needs an argument: -{name}")
                value = argv[i]
                i += 1
        elif eq:
            if value not in _TRUE | _FALSE:
                raise FlagError(f"invalid boolean value {value!r} for -{name}")
            value = "true" if value in _TRUE else ""
        else:
            value = "true"
        given[name] = value
    if i < len(argv):
        raise FlagError(
            f"unexpected argument {argv[i]!r}: llama-swap's command line takes flags only"
        )
    return _serve_arguments(given)


def _serve_arguments(given: dict[str, str]) -> Translated:
    if given.get("version"):
        return Translated([], print_and_exit=f"version: {__version__} (gpulane)")
    for name, value in given.items():
        flag = LLAMA_SWAP_FLAGS[name]
        if flag.handling == "refuses" and value:
            raise FlagError(f"-{name} is not supported: {flag.does}")
    config, directory = given.get("config", ""), given.get("config-dir", "")
    if config and directory:
        # llama-swap merges FILE first, then DIR's files; `serve --config` takes one path.
        raise FlagError(
            "-config and -config-dir together are not supported: gpulane reads one config "
            "path; move the -config file into the -config-dir directory (its files merge "
            "in name order) or merge the directory's files into the -config file"
        )
    config = config or directory
    if not config:
        raise FlagError("at least one of -config FILE or -config-dir DIR must be provided")
    cert, key = given.get("tls-cert-file", ""), given.get("tls-key-file", "")
    if bool(cert) != bool(key):
        raise FlagError("both -tls-cert-file and -tls-key-file must be provided for TLS")
    listen = given.get("listen") or (":8443" if cert else ":8080")
    argv = ["serve", "--config", config, "--listen", listen]
    if cert:
        argv += ["--tls-cert-file", cert, "--tls-key-file", key]
    if given.get("watch-config"):
        argv.append("--watch-config")
    warnings = tuple(
        f"-{name}: ignored: {flag.does}"
        for name, flag in LLAMA_SWAP_FLAGS.items()
        if flag.handling == "warns" and given.get(name)
    )
    return Translated(argv, warnings=warnings)
