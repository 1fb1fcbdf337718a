"""The schema, as SQLAlchemy Core tables. Alembic owns the database; this is its target.

`events` is the source of truth. Everything else is a read model that only
`read_model.project` writes, in the same transaction as the events it derives
from, so `gpulane db rebuild` can recompute it at any time. Times are REAL unix
seconds (double precision on PostgreSQL) so `datetime(x, 'unixepoch')` works in
ad-hoc SQL; the events keep exact nanoseconds in `data`. Integers are 64-bit
(`INTEGER`) on both databases. Documented column by column in docs/events.md.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Table,
    Text,
)

metadata = MetaData()

INTEGER = BigInteger().with_variant(Integer(), "sqlite")
"""Every integer column: 64 bits, as SQLite's are (migrations/__init__.py)."""

events = Table(
    "events",
    metadata,
    Column("seq", INTEGER, primary_key=True, autoincrement=True),
    Column("at", Float, nullable=False),
    Column("type", Text, nullable=False),
    Column("request_id", Text, nullable=True),
    Column("model", Text, nullable=True),
    Column("data", Text, nullable=False),
    Index("ix_events_request_id", "request_id"),
    Index("ix_events_type_at", "type", "at"),
    Index("ix_events_at", "at"),
    sqlite_autoincrement=True,
)

OPEN_STATUSES = ("queued", "running")

requests = Table(
    "requests",
    metadata,
    Column("id", Text, primary_key=True),
    # NULL only for a request rejected before its model was known.
    Column("model", Text),
    Column("model_requested", Text),
    Column("endpoint", Text, nullable=False),
    Column("priority", INTEGER, nullable=False),
    Column("band", Text, nullable=False),
    # queued, running, completed, failed, cancelled, abandoned
    Column("status", Text, nullable=False),
    Column("durable", Boolean, nullable=False),
    Column("attempt", INTEGER, nullable=False),
    Column("caller", Text),
    Column("idempotency_key", Text),
    Column("enqueue_seq", INTEGER, nullable=False),
    Column("enqueued_at", Float, nullable=False),
    Column("dispatched_at", Float),
    Column("started_at", Float),
    Column("finished_at", Float),
    Column("score", Float),
    Column("queue_wait_ms", Float),
    Column("swap_ms", Float),
    Column("run_ms", Float),
    Column("ttfb_ms", Float),
    Column("bytes", INTEGER),
    Column("http_status", INTEGER),
    Column("error", Text),
    Column("input_tokens", INTEGER),
    Column("output_tokens", INTEGER),
    Column("tokens_per_second", Float),
    Column("cancel_reason", Text),
    Column("job", JSON),
    Index("ix_requests_status", "status"),
    Index("ix_requests_band_enqueued_at", "band", "enqueued_at"),
    Index("ix_requests_finished_at", "finished_at"),
    Index("ix_requests_idempotency_key", "idempotency_key"),
    # Newest-first lists, of everyone and of one caller (migration 0003).
    Index("ix_requests_enqueue_seq", "enqueue_seq"),
    Index("ix_requests_caller_enqueue_seq", "caller", "enqueue_seq"),
)

# One row per upstream process; rows with stopped_at NULL are what crash recovery stops.
processes = Table(
    "processes",
    metadata,
    Column("seq", INTEGER, primary_key=True, autoincrement=False),
    Column("model", Text, nullable=False),
    Column("pid", INTEGER, nullable=False),
    Column("cmdline", JSON, nullable=False),
    Column("port", INTEGER),
    Column("started_at", Float, nullable=False),
    Column("stopped_at", Float),
    Column("stop_reason", Text),
    Column("exit_code", INTEGER),
    Index("ix_processes_pid", "pid"),
)

# One row per swap. Also how SwapFinished finds the request that caused it
# (the events themselves only name the model).
swaps = Table(
    "swaps",
    metadata,
    Column("seq", INTEGER, primary_key=True, autoincrement=False),
    Column("from_model", Text),
    Column("to_model", Text, nullable=False),
    Column("request_id", Text),
    Column("started_at", Float, nullable=False),
    Column("finished_at", Float),
    Column("duration_ms", Float),
    Column("error", Text),
    Index("ix_swaps_open", "to_model", "finished_at"),
)

# Last event seq each projection has applied, written with the projection itself.
projection_position = Table(
    "projection_position",
    metadata,
    Column("name", Text, primary_key=True),
    Column("seq", INTEGER, nullable=False),
)

READ_MODELS = (requests, processes, swaps, projection_position)

# The upstream's answer to a durable job (Prefer: respond-async). Not a read
# model: bodies are not in the events. Written before the job's completion
# event, pruned after jobs.resultRetention.
job_results = Table(
    "job_results",
    metadata,
    Column("request_id", Text, primary_key=True),
    Column("http_status", INTEGER, nullable=False),
    Column("headers", Text, nullable=False),
    Column("body", LargeBinary, nullable=False),
    Column("stored_at", Float, nullable=False),
    Index("ix_job_results_stored_at", "stored_at"),
)

# A durable job's request body, raw bytes, written before its enqueue event
# (which keeps only method, path and headers). Not a read model: bodies are not
# in the events. Deleted with the job's result after jobs.resultRetention.
job_bodies = Table(
    "job_bodies",
    metadata,
    Column("request_id", Text, primary_key=True),
    Column("stored_at", Float, nullable=False),
    # Last: SQLite writes a trailing zeroblob() without allocating it (job_bodies.py).
    Column("body", LargeBinary, nullable=False),
)

# Which gpulane serves this log: one row (name 'leader'). `term` rises at every
# take-over and fences the holder's writes; a live lease (expires_at in the
# future, held by another pid) makes a second server refuse to start.
server_lease = Table(
    "server_lease",
    metadata,
    Column("name", Text, primary_key=True),
    Column("term", INTEGER, nullable=False),
    Column("holder", Text, nullable=False),
    Column("pid", INTEGER, nullable=False),
    Column("host", Text, nullable=False),
    Column("listen", Text, nullable=False),
    Column("acquired_at", Float, nullable=False),
    Column("renewed_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
)

# Files of the OpenAI Files API (`/v1/files`): a Batch API input, or a batch's
# output and error files. Not a read model: contents are not in the events. A
# file is written whole in one transaction, so it is never half there.
files = Table(
    "files",
    metadata,
    Column("id", Text, primary_key=True),
    Column("caller", Text),
    Column("purpose", Text, nullable=False),
    Column("filename", Text, nullable=False),
    Column("bytes", INTEGER, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("content", LargeBinary, nullable=False),
    Index("ix_files_caller_created_at", "caller", "created_at"),
)

# Batches of the OpenAI Batch API (`/v1/batches`). Each line of the input file
# is a durable job (`batch_lines.request_id` -> `requests.id`); a batch's
# progress derives from its lines' jobs, and its row holds only what is the
# batch's own: its status once decided, its times and its output files.
batches = Table(
    "batches",
    metadata,
    Column("id", Text, primary_key=True),
    Column("caller", Text),
    Column("endpoint", Text, nullable=False),
    Column("input_file_id", Text, nullable=False),
    Column("completion_window", Text, nullable=False),
    Column("metadata", JSON),
    Column("priority", INTEGER, nullable=False),
    # validating, failed, in_progress, cancelling, completed, expired, cancelled
    Column("status", Text, nullable=False),
    Column("errors", JSON),
    Column("total", INTEGER, nullable=False),
    Column("output_file_id", Text),
    Column("error_file_id", Text),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
    Column("in_progress_at", Float),
    Column("finalizing_at", Float),
    Column("completed_at", Float),
    Column("failed_at", Float),
    Column("expired_at", Float),
    Column("cancelling_at", Float),
    Column("cancelled_at", Float),
    Index("ix_batches_caller_created_at", "caller", "created_at"),
    Index("ix_batches_status", "status"),
)

# One row per line of a batch's input file, written with the batch: its
# custom_id and the durable job that answers it (NULL when the line was
# answered without one: `error` says why, e.g. its model is not configured).
batch_lines = Table(
    "batch_lines",
    metadata,
    Column("batch_id", Text, primary_key=True),
    Column("line", INTEGER, primary_key=True),
    Column("custom_id", Text, nullable=False),
    # The configured model its job runs on (its body may name it otherwise: useModelName).
    Column("model", Text),
    Column("request_id", Text),
    Column("error", JSON),
    Index("ix_batch_lines_request_id", "request_id"),
)
