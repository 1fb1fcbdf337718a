"""The `gpulane` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpulane", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check-config", help="validate a config file and print it resolved"
    )
    check.add_argument("file", help="path to the YAML config")
    check.add_argument(
        "--format", choices=("yaml", "json"), default="yaml", help="output format (default yaml)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "check-config":
        from app.cli_config import check_config_command

        return check_config_command(args.file, output_format=args.format)
    return 2  # unreachable: argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
