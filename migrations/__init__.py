"""Alembic migrations for the gpulane database (run from code by app.store.migrate)."""

import sqlalchemy as sa

INTEGER = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
"""Every integer column: 64 bits, as SQLite's integers are (a priority, a seq).
INTEGER on SQLite, so an INTEGER PRIMARY KEY stays SQLite's rowid; BIGINT on
PostgreSQL."""
