"""Alembic environment: the engine comes from app.store.migrate, the target from tables.py."""

from __future__ import annotations

from alembic import context

from app.store.engine import create_engine
from app.store.tables import metadata

config = context.config

MIGRATION_LOCK = 0x67706C616E65  # "gplane": PostgreSQL's advisory lock key for migrations


def run_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    engine = config.attributes.get("engine")
    owned = engine is None
    if engine is None:
        # `alembic -x db=PATH ...` from a shell, for developers.
        engine = create_engine(context.get_x_argument(as_dictionary=True)["db"])
    try:
        with engine.connect() as connection:
            # Our BEGIN (engine.py) makes SQLite DDL transactional: a failed
            # migration leaves the previous schema, not half of the next one.
            # IMMEDIATE takes SQLite's write lock before alembic reads the revision:
            # two servers starting on a new file migrate one after the other, the
            # second finding the head (a deferred BEGIN's read snapshot could not be
            # upgraded to a write once the first committed: "database is locked").
            if connection.dialect.name == "sqlite":
                connection.execution_options(sqlite_begin="IMMEDIATE")
            context.configure(
                connection=connection,
                target_metadata=metadata,
                transactional_ddl=True,
                render_as_batch=True,
            )
            with context.begin_transaction():
                if connection.dialect.name == "postgresql":
                    # The same on PostgreSQL.
                    connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
                context.run_migrations()
            connection.commit()
    finally:
        if owned:
            engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
