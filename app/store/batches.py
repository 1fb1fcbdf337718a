"""The queries of the Batch API: a batch's own rows and its lines' jobs.

A batch, its lines and their bodies (in `job_bodies`, where every durable job
keeps its body) are written in one transaction; each line then becomes a
durable job with that id. Everything a batch reports beyond its own decisions
derives from its lines' rows in `requests` and `job_results`, so it needs no
recovery of its own. A batch's output and error files are written in the
transaction that records its end. Every function opens its own connection, so
the web layer calls them in a thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, RowMapping, and_, case, func, select, update

from app.store.files import insert_file
from app.store.tables import batch_lines, batches, job_bodies, job_results, requests

OPEN_BATCH_STATUSES = ("validating", "in_progress", "cancelling")
ENDED_JOB_STATUSES = ("completed", "failed", "cancelled", "abandoned")


def create_batch(
    engine: Engine,
    batch: dict[str, Any],
    lines: Sequence[dict[str, Any]],
    bodies: Sequence[tuple[str, bytes]],
) -> None:
    """The batch, its lines and its lines' bodies, all or nothing."""
    now = time.time()
    with engine.begin() as conn:
        conn.execute(batches.insert().values(batch))
        if lines:
            conn.execute(batch_lines.insert(), list(lines))
        if bodies:
            conn.execute(
                job_bodies.insert(),
                [{"request_id": rid, "body": body, "stored_at": now} for rid, body in bodies],
            )


def batch_row(engine: Engine, batch_id: str) -> RowMapping | None:
    with engine.connect() as conn:
        return conn.execute(select(batches).where(batches.c.id == batch_id)).mappings().first()


def list_batches(
    engine: Engine, caller: str | None, limit: int, after: str | None
) -> tuple[list[RowMapping], bool]:
    """Newest first (only `caller`'s when given), after the batch `after`."""
    query = select(batches)
    if caller is not None:
        query = query.where(batches.c.caller == caller)
    with engine.connect() as conn:
        if after is not None:
            mark = conn.execute(select(batches.c.created_at).where(batches.c.id == after)).scalar()
            if mark is not None:
                query = query.where(
                    (batches.c.created_at < mark)
                    | ((batches.c.created_at == mark) & (batches.c.id < after))
                )
        query = query.order_by(batches.c.created_at.desc(), batches.c.id.desc())
        rows = list(conn.execute(query.limit(limit + 1)).mappings().all())
    return rows[:limit], len(rows) > limit


def open_batches(engine: Engine) -> list[RowMapping]:
    query = select(batches).where(batches.c.status.in_(OPEN_BATCH_STATUSES))
    with engine.connect() as conn:
        ordered = query.order_by(batches.c.created_at, batches.c.id)
        return list(conn.execute(ordered).mappings().all())


def line_summary(engine: Engine, batch_id: str) -> dict[str, int]:
    """How many lines: `total`, `ended` (their job ended, or answered without
    one), `succeeded` (completed with a 2xx answer), `unqueued` (a job id but
    no job on disk yet): one aggregate query, however many lines."""
    job = requests.c
    query = (
        select(
            func.count().label("total"),
            func.sum(
                case(
                    (batch_lines.c.request_id.is_(None) | job.status.in_(ENDED_JOB_STATUSES), 1),
                    else_=0,
                )
            ).label("ended"),
            func.sum(
                case(
                    (
                        and_(job.status == "completed", job.http_status.between(200, 299)),
                        1,
                    ),
                    else_=0,
                )
            ).label("succeeded"),
            func.sum(
                case((batch_lines.c.request_id.is_not(None) & job.id.is_(None), 1), else_=0)
            ).label("unqueued"),
        )
        .select_from(batch_lines.outerjoin(requests, job.id == batch_lines.c.request_id))
        .where(batch_lines.c.batch_id == batch_id)
    )
    with engine.connect() as conn:
        row = conn.execute(query).mappings().one()
    return {k: int(row[k] or 0) for k in ("total", "ended", "succeeded", "unqueued")}


def line_states(
    engine: Engine, batch_id: str, offset: int = 0, limit: int | None = None
) -> list[RowMapping]:
    """Each line with its job's status (NULL: not queued yet, or never: `error`);
    with `limit`, only lines `offset`.. (in line order)."""
    query = (
        select(
            batch_lines.c.line,
            batch_lines.c.custom_id,
            batch_lines.c.request_id,
            batch_lines.c.model,
            batch_lines.c.error.label("line_error"),
            requests.c.status,
            requests.c.http_status,
            requests.c.error,
            requests.c.cancel_reason,
        )
        .select_from(batch_lines.outerjoin(requests, requests.c.id == batch_lines.c.request_id))
        .where(batch_lines.c.batch_id == batch_id)
        .order_by(batch_lines.c.line)
    )
    if limit is not None:
        query = query.offset(offset).limit(limit)
    with engine.connect() as conn:
        return list(conn.execute(query).mappings().all())


def line_outcomes(engine: Engine, batch_id: str) -> list[RowMapping]:
    """`line_states` with each line's stored answer, for the output files."""
    query = (
        select(
            batch_lines.c.line,
            batch_lines.c.custom_id,
            batch_lines.c.request_id,
            batch_lines.c.error.label("line_error"),
            requests.c.status,
            requests.c.error,
            requests.c.cancel_reason,
            job_results.c.http_status.label("result_status"),
            job_results.c.body.label("result_body"),
        )
        .select_from(
            batch_lines.outerjoin(requests, requests.c.id == batch_lines.c.request_id).outerjoin(
                job_results, job_results.c.request_id == batch_lines.c.request_id
            )
        )
        .where(batch_lines.c.batch_id == batch_id)
        .order_by(batch_lines.c.line)
    )
    with engine.connect() as conn:
        return list(conn.execute(query).mappings().all())


def line_model(engine: Engine, batch_id: str, line: int) -> str:
    """The configured model a line's job runs on."""
    query = select(batch_lines.c.model).where(
        batch_lines.c.batch_id == batch_id, batch_lines.c.line == line
    )
    with engine.connect() as conn:
        return str(conn.execute(query).scalar())


def set_line_error(engine: Engine, batch_id: str, line: int, error: dict[str, Any]) -> None:
    """A line that could not be queued is answered by this error, without a job."""
    with engine.begin() as conn:
        conn.execute(
            update(batch_lines)
            .where(batch_lines.c.batch_id == batch_id, batch_lines.c.line == line)
            .values(request_id=None, error=error)
        )


def set_batch(engine: Engine, batch_id: str, when: Sequence[str], **values: Any) -> bool:
    """Update the batch if its status is one of `when`; whether it was."""
    with engine.begin() as conn:
        changed = conn.execute(
            update(batches)
            .where(batches.c.id == batch_id, batches.c.status.in_(list(when)))
            .values(**values)
        )
        return bool(changed.rowcount)


def finish_batch(
    engine: Engine, batch_id: str, outputs: Sequence[dict[str, Any]], **values: Any
) -> bool:
    """Record the batch's end and store its output files, in one transaction;
    False (nothing written) if it had already ended."""
    with engine.begin() as conn:
        changed = conn.execute(
            update(batches)
            .where(batches.c.id == batch_id, batches.c.status.in_(OPEN_BATCH_STATUSES))
            .values(**values)
        )
        if not changed.rowcount:
            return False
        for row in outputs:
            insert_file(conn, row)
    return True


def batch_of_request(engine: Engine, request_id: str) -> str | None:
    """The batch whose line `request_id` is (an indexed lookup), or None."""
    query = select(batch_lines.c.batch_id).where(batch_lines.c.request_id == request_id)
    with engine.connect() as conn:
        return conn.execute(query.limit(1)).scalar()
