"""The queries of durable jobs: results, idempotency keys and listings.

Results live in `job_results`, beside the read model (`requests`); the events
stay when results are pruned. Every function opens its own connection, so the
web layer calls them in a thread.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Connection, Engine, RowMapping, select
from sqlalchemy import delete as sql_delete

from app.store.tables import job_results, requests

StoredResult = tuple[int, list[tuple[str, str]], bytes]
"""http status, headers, body: an answer exactly as the upstream sent it."""


def find_idempotency_key(engine: Engine, key: str, caller: str | None) -> tuple[str, str] | None:
    """(job id, body sha256) of the latest job `caller` sent with this key, if any:
    keys are per caller, so one caller can neither reach nor block another's job."""
    same_caller = requests.c.caller.is_(None) if caller is None else requests.c.caller == caller
    query = select(requests.c.id, requests.c.job).where(
        requests.c.idempotency_key == key, same_caller
    )
    with engine.connect() as conn:
        row = conn.execute(query.order_by(requests.c.enqueue_seq.desc()).limit(1)).first()
    if row is None:
        return None
    job = row.job if isinstance(row.job, dict) else json.loads(row.job or "{}")
    return row.id, job.get("body_sha256", "")


def store_result(
    engine: Engine,
    request_id: str,
    status: int,
    headers: Sequence[tuple[str, str]],
    body: bytes,
    fence: Callable[[Connection], None] | None = None,
) -> None:
    """Keep a job's answer. `fence` runs first in the same transaction (the server
    lease, app/store/lease.py): a leader taken over stores nothing more."""
    row = {
        "request_id": request_id,
        "http_status": status,
        "headers": json.dumps(list(headers)),
        "body": body,
        "stored_at": time.time(),
    }
    with engine.begin() as conn:
        if fence is not None:
            fence(conn)
        # A job re-run after a crash overwrites the result of the run that never completed.
        conn.execute(sql_delete(job_results).where(job_results.c.request_id == request_id))
        conn.execute(job_results.insert().values(row))


def prune_results(engine: Engine, older_than: float) -> int:
    """Delete results stored before `older_than` (unix seconds); returns how many."""
    with engine.begin() as conn:
        return conn.execute(
            sql_delete(job_results).where(job_results.c.stored_at < older_than)
        ).rowcount


def job_rows(engine: Engine, request_id: str) -> tuple[RowMapping | None, RowMapping | None]:
    """The job's `requests` row and its `job_results` row (each None if absent)."""
    with engine.connect() as conn:
        row = conn.execute(select(requests).where(requests.c.id == request_id)).mappings().first()
        result = (
            conn.execute(select(job_results).where(job_results.c.request_id == request_id))
            .mappings()
            .first()
        )
    return row, result


def job_result(engine: Engine, request_id: str) -> StoredResult | None:
    _, result = job_rows(engine, request_id)
    if result is None:
        return None
    return result["http_status"], json.loads(result["headers"]), result["body"]


def list_jobs(
    engine: Engine, status: str | None, limit: int, caller: str | None = None
) -> list[tuple[RowMapping, dict[str, Any] | None]]:
    """Durable jobs newest first (only `caller`'s when given), each with its result:
    one query, however many jobs."""
    query = (
        select(
            requests,
            job_results.c.request_id.label("result_id"),
            job_results.c.http_status.label("result_status"),
            job_results.c.headers.label("result_headers"),
            job_results.c.body.label("result_body"),
        )
        .outerjoin(job_results, job_results.c.request_id == requests.c.id)
        .where(requests.c.durable.is_(True))
    )
    if status:
        query = query.where(requests.c.status == status)
    if caller is not None:
        query = query.where(requests.c.caller == caller)
    with engine.connect() as conn:
        found = conn.execute(query.order_by(requests.c.enqueue_seq.desc()).limit(limit))
        rows = list(found.mappings().all())
    out: list[tuple[RowMapping, dict[str, Any] | None]] = []
    for row in rows:
        result = None
        if row["result_id"] is not None:
            result = {
                "http_status": row["result_status"],
                "headers": row["result_headers"],
                "body": row["result_body"],
            }
        out.append((row, result))
    return out
