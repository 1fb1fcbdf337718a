"""`gpulane db copy FROM TO`: a whole log from one database to another, SQLite
to PostgreSQL and back.

Every table is copied row for row, seqs included, so the copy is the same log:
`replay --verify` gives the same answer on both and `db check` passes on the
copy. FROM is read in one transaction (one snapshot: SQLite's read
transaction, PostgreSQL's REPEATABLE READ), so a server may keep serving it;
TO is written in one transaction, so a failed copy leaves nothing behind.
TO must hold no events. JSON columns travel as their text, exactly as stored.

The lease row travels released (its term kept): the copy is served by
whoever starts on it next, and terms keep rising.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy
from sqlalchemy import JSON, Text, cast, column, func, select, table
from sqlalchemy.engine import Engine
from sqlalchemy.types import NullType

from app.store.tables import events, metadata, server_lease

COPY_BATCH = 5000
"""Rows read and written per step."""


class CopyRefused(Exception):
    """TO already holds a log (or FROM is not at the schema TO has)."""


@dataclass(frozen=True)
class Copied:
    events: int
    last_seq: int
    rows: int
    """Rows of every table, events included."""


def copy_log(source: Engine, target: Engine) -> Copied:
    """Copy every row of gpulane's tables from `source` to `target` (both migrated
    to the same revision by the caller); raises CopyRefused when `target` has events."""
    with source.connect() as src, target.connect() as dst:
        if src.dialect.name == "postgresql":
            src.execution_options(isolation_level="REPEATABLE READ")
        dst.execution_options(sqlite_begin="IMMEDIATE")
        with src.begin(), dst.begin():
            held = dst.execute(select(func.count()).select_from(events)).scalar_one()
            if held:
                raise CopyRefused(
                    f"it holds a log already ({held} events); copy into a new, empty database"
                )
            rows = 0
            for source_table in metadata.sorted_tables:
                dst.execute(source_table.delete())  # what a new database may hold: nothing
                rows += _copy_table(src, dst, source_table)
            count, last = dst.execute(
                select(func.count(), func.coalesce(func.max(events.c.seq), 0))
            ).one()
    return Copied(events=int(count), last_seq=int(last), rows=rows)


def _copy_table(src: sqlalchemy.Connection, dst: sqlalchemy.Connection, source: Any) -> int:
    # JSON as its text both ways, bound untyped (no cast to VARCHAR, which PostgreSQL
    # will not put in a json column): SQLAlchemy's JSON would turn SQL NULL into 'null'.
    read = [cast(c, Text).label(c.name) if isinstance(c.type, JSON) else c for c in source.columns]
    write = table(
        source.name,
        *(
            column(c.name, NullType() if isinstance(c.type, JSON) else c.type)
            for c in source.columns
        ),
    )
    options = {"yield_per": COPY_BATCH} if src.dialect.name != "sqlite" else {}
    result = src.execute(
        select(*read).order_by(*source.primary_key.columns), execution_options=options
    )
    count = 0
    for chunk in result.mappings().partitions(COPY_BATCH):
        values = [dict(row) for row in chunk]
        if source is server_lease:
            for value in values:
                value["expires_at"] = min(value["expires_at"], value["renewed_at"])
        dst.execute(write.insert(), values)
        count += len(values)
    return count
