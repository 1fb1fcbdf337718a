"""Alembic driven from code: no alembic.ini, the script directory is the `migrations` package."""

from __future__ import annotations

from pathlib import Path

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
