"""The read models (requests, processes, swaps) as a function of the event log.

`project(cursor, seq, event)` is the only code that writes these tables. The
event store calls it for each event in the transaction that appends the event,
and `gpulane db rebuild` calls it for every event in seq order, so the live
tables and rebuilt ones cannot drift apart. The events that end a request
also delete its job body (`job_bodies`, not a read model) in that transaction.

The statements are plain SQL, portable between SQLite and PostgreSQL, run on
the driver's cursor of the current SQLAlchemy transaction (`cursor.py`): this
is the writer's hot path, and the driver caches prepared statements by their text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from app.core import events as ev
from app.store.cursor import Cursor
from app.store.tables import READ_MODELS

POSITION_NAME = "read_models"
"""The `projection_position` row that says which seq the read models reflect."""

_NS = 1e9
_json = msgspec.json.Encoder()


def seconds(at_ns: int) -> float:
    """Event time as the REAL unix seconds the tables hold."""
    return at_ns / _NS


def project(cur: Cursor, seq: int, event: ev.AnyEvent) -> None:
    """Apply one event (already stored with `seq`) to the read models."""
    handler = _HANDLERS.get(type(event))
    if handler is not None:
        handler(cur, seq, event)


def project_all(cur: Cursor, items: Iterable[tuple[int, ev.AnyEvent]]) -> int:
    """Apply events in order and record the last seq as the position; returns the count."""
    last = None
    count = 0
    for seq, event in items:
        project(cur, seq, event)
        last = seq
        count += 1
    if last is not None:
        set_position(cur, last)
    return count


def set_position(cur: Cursor, seq: int) -> None:
    cur.execute(_SET_POSITION, (POSITION_NAME, seq))


def clear(cur: Cursor) -> None:
    """Empty every read model, before a rebuild."""
    for table in READ_MODELS:
        cur.execute(f"DELETE FROM {table.name}")


_SET_POSITION = (
    "INSERT INTO projection_position (name, seq) VALUES (?, ?) "
    "ON CONFLICT (name) DO UPDATE SET seq = excluded.seq"
)

# A new attempt starts clean: the row shows the current attempt, the log keeps the rest.
_RESET_ATTEMPT = (
    "status = 'queued', attempt = :attempt, dispatched_at = NULL, started_at = NULL, "
    "finished_at = NULL, score = NULL, queue_wait_ms = NULL, swap_ms = NULL, run_ms = NULL, "
    "ttfb_ms = NULL, bytes = NULL, http_status = NULL, error = NULL, input_tokens = NULL, "
    "output_tokens = NULL, tokens_per_second = NULL, cancel_reason = NULL"
)

# Re-enqueueing a known id (a retry) keeps its arrival order and enqueue time.
_ENQUEUED = (
    "INSERT INTO requests (id, model, model_requested, endpoint, priority, band, status, "
    "durable, attempt, caller, idempotency_key, enqueue_seq, enqueued_at, job) VALUES "
    "(:id, :model, :model_requested, :endpoint, :priority, :band, 'queued', :durable, "
    ":attempt, :caller, :idempotency_key, :seq, :enqueued_at, :job) "
    f"ON CONFLICT (id) DO UPDATE SET {_RESET_ATTEMPT}"
)


def _enqueued(cur: Cursor, seq: int, e: Any) -> None:
    cur.execute(
        _ENQUEUED,
        {
            "id": e.request_id,
            "model": e.model,
            "model_requested": e.model_requested,
            "endpoint": e.endpoint,
            "priority": e.priority,
            "band": e.band,
            "durable": e.durable,
            "attempt": e.attempt,
            "caller": e.caller,
            "idempotency_key": e.idempotency_key,
            "seq": seq,
            "enqueued_at": seconds(e.enqueued_at if e.enqueued_at is not None else e.at),
            "job": None if e.job is None else _json.encode(e.job).decode(),
        },
    )


def _rejected(cur: Cursor, seq: int, e: Any) -> None:
    # Failed at admission: never queued, but every request the server saw gets a row.
    at = seconds(e.at)
    cur.execute(
        "INSERT INTO requests (id, model, model_requested, endpoint, priority, band, status, "
        "durable, attempt, caller, enqueue_seq, enqueued_at, finished_at, http_status, error) "
        "VALUES (?, NULL, ?, ?, ?, ?, 'failed', FALSE, 1, ?, ?, ?, ?, ?, ?)",
        (
            e.request_id,
            e.model_requested,
            e.endpoint,
            e.priority,
            e.band,
            e.caller,
            seq,
            at,
            at,
            e.http_status,
            e.error,
        ),
    )


def _requeued(cur: Cursor, seq: int, e: Any) -> None:
    cur.execute(
        f"UPDATE requests SET {_RESET_ATTEMPT} WHERE id = :id",
        {"id": e.request_id, "attempt": e.attempt},
    )


def _scores_computed(cur: Cursor, seq: int, e: Any) -> None:
    cur.execute("UPDATE requests SET score = ? WHERE id = ?", (e.winner.total, e.request_id))


# The wait (app/core/wait.py): arrival to the dispatch of the last attempt, or to
# the end of one never dispatched (a new attempt clears it, _RESET_ATTEMPT).
_WAIT_UNTIL_AT = "queue_wait_ms = COALESCE(queue_wait_ms, (:at - enqueued_at) * 1000.0)"


def _dispatched(cur: Cursor, seq: int, e: Any) -> None:
    cur.execute(
        "UPDATE requests SET status = 'running', attempt = :attempt, dispatched_at = :at, "
        f"{_WAIT_UNTIL_AT} WHERE id = :id",
        {"id": e.request_id, "at": seconds(e.at), "attempt": e.attempt},
    )


def _started(cur: Cursor, seq: int, e: Any) -> None:
    cur.execute("UPDATE requests SET started_at = ? WHERE id = ?", (seconds(e.at), e.request_id))


# Common to every terminal event; run_ms falls back to the time since started, and
# a request never dispatched waited until its end.
_FINISH = (
    "UPDATE requests SET status = :status, finished_at = :at, "
    f"run_ms = COALESCE(:run_ms, (:at - started_at) * 1000.0), {_WAIT_UNTIL_AT}"
)
# A durable job's body (app/store/job_bodies.py) is needed until its job ends,
# and goes in the transaction that records the end: never kept, never missing.
_DROP_BODY = "DELETE FROM job_bodies WHERE request_id = ?"


def _completed(cur: Cursor, seq: int, e: Any) -> None:
    cur.execute(
        f"{_FINISH}, http_status = :http_status, bytes = :bytes, ttfb_ms = :ttfb_ms, "
        "input_tokens = :input_tokens, output_tokens = :output_tokens, "
        "tokens_per_second = :tokens_per_second WHERE id = :id",
        {
            "id": e.request_id,
            "status": "completed",
            "at": seconds(e.at),
            "run_ms": e.run_ms,
            "http_status": e.http_status,
            "bytes": e.bytes,
            "ttfb_ms": e.ttfb_ms,
            "input_tokens": e.input_tokens,
            "output_tokens": e.output_tokens,
            "tokens_per_second": e.tokens_per_second,
        },
    )
    cur.execute(_DROP_BODY, (e.request_id,))


def _failed(cur: Cursor, seq: int, e: Any) -> None:
    cur.execute(
        f"{_FINISH}, error = :error, http_status = :http_status WHERE id = :id",
        {
            "id": e.request_id,
            "status": "failed",
            "at": seconds(e.at),
            "run_ms": None,
            "error": e.error,
            "http_status": e.http_status,
        },
    )
    cur.execute(_DROP_BODY, (e.request_id,))


def _cancelled(cur: Cursor, seq: int, e: Any) -> None:
    cur.execute(
        f"{_FINISH}, cancel_reason = :reason WHERE id = :id",
        {
            "id": e.request_id,
            "status": "cancelled",
            "at": seconds(e.at),
            "run_ms": None,
            "reason": e.reason,
        },
    )
    cur.execute(_DROP_BODY, (e.request_id,))


def _abandoned(cur: Cursor, seq: int, e: Any) -> None:
    cur.execute(
        f"{_FINISH} WHERE id = :id",
        {"id": e.request_id, "status": "abandoned", "at": seconds(e.at), "run_ms": None},
    )


def _swap_started(cur: Cursor, seq: int, e: Any) -> None:
    cur.execute(
        "INSERT INTO swaps (seq, from_model, to_model, request_id, started_at) "
        "VALUES (?, ?, ?, ?, ?)",
        (seq, e.from_model, e.to_model, e.request_id, seconds(e.at)),
    )


# The open swap to a model is the latest one started and not finished.
_OPEN_SWAP = "(SELECT max(seq) FROM swaps WHERE to_model = :model AND finished_at IS NULL)"


def _finish_swap(cur: Cursor, e: Any, error: str | None) -> None:
    params = {"model": e.model, "at": seconds(e.at), "ms": e.duration_ms, "error": error}
    cur.execute(
        "UPDATE requests SET swap_ms = :ms "
        f"WHERE id = (SELECT request_id FROM swaps WHERE seq = {_OPEN_SWAP})",
        params,
    )
    cur.execute(
        "UPDATE swaps SET finished_at = :at, duration_ms = :ms, error = :error "
        f"WHERE seq = {_OPEN_SWAP}",
        params,
    )


def _swap_finished(cur: Cursor, seq: int, e: Any) -> None:
    _finish_swap(cur, e, None)


def _swap_failed(cur: Cursor, seq: int, e: Any) -> None:
    _finish_swap(cur, e, e.error)


def _server_started(cur: Cursor, seq: int, e: Any) -> None:
    # A swap in progress when the previous process died will never finish.
    cur.execute(
        "UPDATE swaps SET finished_at = ?, error = 'interrupted by restart' "
        "WHERE finished_at IS NULL",
        (seconds(e.at),),
    )


def _process_started(cur: Cursor, seq: int, e: Any) -> None:
    cur.execute(
        "INSERT INTO processes (seq, model, pid, cmdline, port, started_at) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        (seq, e.model, e.pid, _json.encode(e.cmdline).decode(), e.port, seconds(e.at)),
    )


def _process_stopped(cur: Cursor, seq: int, e: Any) -> None:
    cur.execute(
        "UPDATE processes SET stopped_at = ?, stop_reason = ?, exit_code = ? "
        "WHERE pid = ? AND model = ? AND stopped_at IS NULL",
        (seconds(e.at), e.reason, e.exit_code, e.pid, e.model),
    )


_HANDLERS: dict[type, Callable[[Cursor, int, Any], None]] = {
    ev.ServerStarted: _server_started,
    ev.RequestEnqueued: _enqueued,
    ev.ScoresComputed: _scores_computed,
    ev.RequestDispatched: _dispatched,
    ev.SwapStarted: _swap_started,
    ev.ProcessStarted: _process_started,
    ev.SwapFinished: _swap_finished,
    ev.SwapFailed: _swap_failed,
    ev.ProcessStopped: _process_stopped,
    ev.RequestStarted: _started,
    ev.RequestCompleted: _completed,
    ev.RequestFailed: _failed,
    ev.RequestCancelled: _cancelled,
    ev.RequestAbandoned: _abandoned,
    ev.RequestRejected: _rejected,
    ev.RequestRequeued: _requeued,
}
"""Events not listed here change no read model: RecoveryFinished, LeaseAcquired (the
lease row is written by app/store/lease.py, not projected), and RequestRestored
(its row is already queued, or running and reset by the RequestRequeued that follows)."""
