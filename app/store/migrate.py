"""Alembic driven from code: no alembic.ini, the script directory is the `migrations` package."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

import migrations

# __path__, not __file__: an older editable install may map it as a namespace package.
SCRIPT_LOCATION = Path(next(iter(migrations.__path__)))


def alembic_config(engine: Engine | None = None) -> Config:
    """An alembic Config for `migrations/`; env.py uses `engine` when given."""
    config = Config()
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
    if engine is not None:
        config.attributes["engine"] = engine
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(conn: sqlalchemy.Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def is_known_revision(revision: str) -> bool:
    """False for a revision written by a newer gpulane (or something else entirely)."""
    scripts = ScriptDirectory.from_config(alembic_config())
    return any(script.revision == revision for script in scripts.walk_revisions())


def upgrade_to_head(engine: Engine) -> None:
    command.upgrade(alembic_config(engine), "head")


def downgrade_to_base(engine: Engine) -> None:
    command.downgrade(alembic_config(engine), "base")


def schema_differences(conn: sqlalchemy.Connection) -> list[str]:
    """What a database at the head revision lacks of the schema gpulane creates:
    tables, columns and indexes as `app/store/tables.py` describes them, views
    as the migrations write them. One line each.

    A byte changed in SQLite's copy of the schema can rename a column, change a
    type or a view's constant without SQLite finding anything wrong with the file.
    What the database has beyond gpulane's schema (a table or index someone
    added) is not a difference.
    """
    from alembic.autogenerate import compare_metadata

    from app.store.tables import metadata

    lines = [
        line
        for difference in compare_metadata(MigrationContext.configure(conn), metadata)
        for line in _missing(difference)
    ]
    views = dict(_views(conn))
    sqlite = conn.dialect.name == "sqlite"
    for name, sql in _head_views():
        if name not in views:
            lines.append(f"view {name} is missing")
        # PostgreSQL keeps a view as it parsed it, not as written: only SQLite's text compares.
        elif sqlite and " ".join(views[name].split()) != " ".join(sql.split()):
            lines.append(f"view {name}: its SQL is not the one gpulane creates")
    return lines


def _views(conn: sqlalchemy.Connection) -> list[tuple[str, str]]:
    if conn.dialect.name == "sqlite":
        query = "SELECT name, sql FROM sqlite_master WHERE type = 'view' ORDER BY name"
    else:
        query = (
            "SELECT viewname, definition FROM pg_views "
            "WHERE schemaname = current_schema() ORDER BY viewname"
        )
    return [(str(name), str(sql)) for name, sql in conn.exec_driver_sql(query)]


def _head_views() -> list[tuple[str, str]]:
    """The views of a new database migrated to head (in memory, about 50 ms)."""
    engine = sqlalchemy.create_engine("sqlite://", poolclass=sqlalchemy.pool.StaticPool)
    try:
        upgrade_to_head(engine)
        with engine.connect() as conn:
            return _views(conn)
    finally:
        engine.dispose()


def _missing(difference: Any) -> list[str]:
    """compare_metadata's operations to bring the database to the schema, as the
    schema's parts the database lacks or has otherwise."""
    if isinstance(difference, list):  # modify_*: one list per column
        return [line for part in difference for line in _missing(part)]
    op = difference[0]
    if op.startswith("remove_"):
        return []  # the database has more than gpulane's schema
    if op == "add_table":
        return [f"table {difference[1].name} is missing"]
    if op == "add_column":
        return [f"column {difference[2]}.{difference[3].name} is missing"]
    if op in ("add_index", "add_constraint"):
        item = difference[1]
        return [f"{op[4:]} {item.name} on {item.table.name} is missing"]
    if op.startswith("modify_"):
        _, _, table, column, _, existing, wanted = difference
        return [f"column {table}.{column}: {op[7:]} is {existing!r}, not {wanted!r}"]
    return [f"{op}: {difference[1:]!r}"]
