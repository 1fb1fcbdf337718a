"""`gpulane` command line: serve, check-config, db, explain, queue, ui, replay."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from app.llama_swap_cli import FlagError, is_llama_swap_command_line, translate

DB_HELP = "database: an SQLite file's path, or an SQLAlchemy URL (postgresql+psycopg://...)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpulane",
        description="OpenAI-compatible proxy that schedules one GPU by priority, "
        "swap affinity and aging, with an SQLite event log.",
        epilog="llama-swap's command line works too: gpulane -config FILE -listen :8080 "
        "(gpulane -help lists its flags).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", default="config.example.yaml", help="config file (YAML)")
    serve.add_argument(
        "--listen", default="127.0.0.1:8080", help="HOST:PORT to listen on (:PORT: every interface)"
    )
    serve.add_argument("--tls-cert-file", default=None, help="TLS certificate file: serve HTTPS")
    serve.add_argument("--tls-key-file", default=None, help="TLS key file: serve HTTPS")
    serve.add_argument(
        "--db",
        default=None,
        help="database: an SQLite file's path, or an SQLAlchemy URL (sqlite:///PATH, "
        "postgresql+psycopg://USER@HOST:PORT/NAME); default: the config's database.url",
    )
    serve.add_argument(
        "--watch-config",
        action="store_true",
        help="reload the config when its file changes (SIGHUP always reloads it)",
    )
    serve.add_argument(
        "--standby",
        action="store_true",
        help="if another gpulane serves the database, wait beside it (503 `standby`) and "
        "take over when its lease lapses (database.leaseSeconds), instead of exiting",
    )

    check = commands.add_parser("check-config", help="validate a config file and print it resolved")
    check.add_argument("file", help="path to the YAML config")
    check.add_argument(
        "--format",
        choices=("summary", "yaml", "json"),
        default="summary",
        help="summary (default): what matters, for a person; yaml or json: the resolved config",
    )

    db = commands.add_parser("db", help="database maintenance")
    db_commands = db.add_subparsers(dest="db_command", required=True, metavar="DB_COMMAND")
    for name, text in (
        ("upgrade", "apply schema migrations up to the latest"),
        ("rebuild", "recompute every read model from the events table"),
        ("check", "verify integrity, schema and event invariants (exit 1 on failure)"),
    ):
        cmd = db_commands.add_parser(name, help=text)
        cmd.add_argument("--db", default="gpulane.db", help=DB_HELP)
    backup = db_commands.add_parser(
        "backup", help="consistent copy of the database, safe while gpulane is serving"
    )
    backup.add_argument(
        "file", metavar="FILE", help="where to write the copy (replaced if present)"
    )
    backup.add_argument("--db", default="gpulane.db", help=DB_HELP)
    copy = db_commands.add_parser(
        "copy",
        help="copy a whole log into a new database: SQLite to PostgreSQL, and back",
    )
    copy.add_argument("source", metavar="FROM", help="the log to copy (a path or URL)")
    copy.add_argument("target", metavar="TO", help="a new, empty database (a path or URL)")

    explain = commands.add_parser(
        "explain", help="why a request waited: its whole story from the event log"
    )
    explain.add_argument("request_id", metavar="REQUEST_ID", help="the X-Request-Id to explain")
    explain.add_argument("--db", default="gpulane.db", help=DB_HELP)
    explain.add_argument("--json", action="store_true", help="print JSON instead of text")

    commands.add_parser(
        "replay",
        help="re-run recorded history under other parameters (gpulane replay --help)",
        add_help=False,
    )
    ui = commands.add_parser(
        "ui", help="the web console, read-only, over a database (e.g. one copied from a server)"
    )
    ui.add_argument("--db", required=True, help=DB_HELP + " (opened read-only)")
    ui.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ui.add_argument("--port", type=int, default=8090, help="port to listen on (default 8090)")
    queue = commands.add_parser("queue", help="show the live queue of a running gpulane")
    queue.add_argument("--url", default="http://127.0.0.1:8080", help="gpulane base URL")
    queue.add_argument("--api-key", default=None, help="API key (default: $GPULANE_API_KEY)")
    queue.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    if is_llama_swap_command_line(raw):
        try:
            translated = translate(raw)
        except FlagError as exc:
            print(f"gpulane: {exc}", file=sys.stderr)
            return 2
        if translated.print_and_exit is not None:
            print(translated.print_and_exit)
            return 0
        for warning in translated.warnings:
            print(f"gpulane: warning: {warning}", file=sys.stderr)
        raw = translated.argv
    if raw[:1] == ["replay"]:
        # The replay tool owns its arguments (python -m tools.replay takes the same).
        from tools.replay.cli import replay_command

        return replay_command(raw[1:])
    args = build_parser().parse_args(raw)
    try:
        return _run(args)
    except Exception as exc:
        # A damaged database found past its opening (a page read while serving or
        # explaining) gets the same sentence as one found on opening, not a traceback.
        from app.store.engine import unusable

        database = _database_of(args)
        problem = unusable(database, exc) if database is not None else None
        if problem is None:
            raise
        print(f"gpulane: {problem}", file=sys.stderr)
        return 1


def _database_of(args: argparse.Namespace) -> str | None:
    """The database file the command reads, if it reads one."""
    if args.command == "serve" and args.db is None:
        from app.config import load_config

        try:
            from app.store.engine import shown

            return shown(load_config(args.config).database_path)
        except Exception:
            return f"the database named by database.path in {args.config}"
    db = getattr(args, "db", None)
    if db is None:
        return None
    from app.store.engine import shown

    return shown(str(db))


def _run(args: argparse.Namespace) -> int:
    if args.command == "check-config":
        from app.config.commands import check_config_command

        return check_config_command(args.file, output_format=args.format)
    if args.command == "db":
        from app.store import commands

        if args.db_command == "backup":
            return commands.backup(args.db, args.file)
        if args.db_command == "copy":
            return commands.copy(args.source, args.target)
        return int(getattr(commands, args.db_command)(args.db))
    if args.command == "explain":
        from app.report.commands import explain_command

        return explain_command(args.request_id, args.db, args.json)
    if args.command == "queue":
        from app.report.commands import queue_command

        return queue_command(args.url, args.api_key, args.json)
    if args.command == "ui":
        from app.web.console.readonly import ui_command

        return ui_command(args.db, args.host, args.port)
    if args.command == "serve":
        from app.web.serve import serve_command

        return serve_command(
            args.config,
            args.listen,
            args.db,
            tls=(args.tls_cert_file, args.tls_key_file),
            watch=args.watch_config,
            standby=args.standby,
        )
    return 2  # unreachable: argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
