"""The files of the OpenAI Files API (`/v1/files`): uploads and batch outputs.

A file is written whole, with its metadata, in one transaction, so a stored
file is never lost once acknowledged nor half there after a crash. Every
function opens its own connection, so the web layer calls them in a thread.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from sqlalchemy import Connection, Engine, RowMapping, select
from sqlalchemy import delete as sql_delete

from app.store.tables import files

_META = [c for c in files.c if c.name != "content"]


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex


def file_row(
    caller: str | None, purpose: str, filename: str, content: bytes, file_id: str | None = None
) -> dict[str, Any]:
    return {
        "id": file_id or new_file_id(),
        "caller": caller,
        "purpose": purpose,
        "filename": filename,
        "bytes": len(content),
        "created_at": time.time(),
        "content": content,
    }


def insert_file(conn: Connection, row: dict[str, Any]) -> None:
    """Within the caller's transaction (a batch's outputs go with its status)."""
    conn.execute(files.insert().values(row))


def store_file(engine: Engine, row: dict[str, Any]) -> None:
    with engine.begin() as conn:
        insert_file(conn, row)


def file_meta(engine: Engine, file_id: str) -> RowMapping | None:
    with engine.connect() as conn:
        return conn.execute(select(*_META).where(files.c.id == file_id)).mappings().first()


def file_content(engine: Engine, file_id: str) -> tuple[RowMapping, bytes] | None:
    with engine.connect() as conn:
        row = conn.execute(select(files).where(files.c.id == file_id)).mappings().first()
    if row is None:
        return None
    return row, bytes(row["content"])


def list_files(
    engine: Engine,
    caller: str | None,
    purpose: str | None,
    limit: int,
    after: str | None,
    newest_first: bool,
) -> tuple[list[RowMapping], bool]:
    """One page (only `caller`'s when given), after the file `after`; and
    whether more follow."""
    query = select(*_META)
    if caller is not None:
        query = query.where(files.c.caller == caller)
    if purpose is not None:
        query = query.where(files.c.purpose == purpose)
    order = (files.c.created_at, files.c.id)
    with engine.connect() as conn:
        if after is not None:
            mark = conn.execute(select(files.c.created_at).where(files.c.id == after)).scalar()
            if mark is not None:
                if newest_first:
                    query = query.where(
                        (files.c.created_at < mark)
                        | ((files.c.created_at == mark) & (files.c.id < after))
                    )
                else:
                    query = query.where(
                        (files.c.created_at > mark)
                        | ((files.c.created_at == mark) & (files.c.id > after))
                    )
        query = query.order_by(*(c.desc() for c in order) if newest_first else order)
        rows = list(conn.execute(query.limit(limit + 1)).mappings().all())
    return rows[:limit], len(rows) > limit


def delete_file(engine: Engine, file_id: str) -> bool:
    with engine.begin() as conn:
        return bool(conn.execute(sql_delete(files).where(files.c.id == file_id)).rowcount)
