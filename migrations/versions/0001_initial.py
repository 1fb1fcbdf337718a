"""initial schema: events, requests, processes, swaps, projection_position

Revision ID: 0001
Revises:
Create Date: 2025-01-01 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations import INTEGER

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("seq", INTEGER, primary_key=True, autoincrement=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("request_id", sa.Text, nullable=True),
        sa.Column("model", sa.Text, nullable=True),
        sa.Column("data", sa.Text, nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_events_request_id", "events", ["request_id"])
    op.create_index("ix_events_type_at", "events", ["type", "at"])
    op.create_index("ix_events_at", "events", ["at"])

    op.create_table(
        "requests",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("model", sa.Text),
        sa.Column("model_requested", sa.Text),
        sa.Column("endpoint", sa.Text, nullable=False),
        sa.Column("priority", INTEGER, nullable=False),
        sa.Column("band", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("durable", sa.Boolean, nullable=False),
        sa.Column("attempt", INTEGER, nullable=False),
        sa.Column("caller", sa.Text),
        sa.Column("idempotency_key", sa.Text),
        sa.Column("enqueue_seq", INTEGER, nullable=False),
        sa.Column("enqueued_at", sa.Float, nullable=False),
        sa.Column("dispatched_at", sa.Float),
        sa.Column("started_at", sa.Float),
        sa.Column("finished_at", sa.Float),
        sa.Column("score", sa.Float),
        sa.Column("queue_wait_ms", sa.Float),
        sa.Column("swap_ms", sa.Float),
        sa.Column("run_ms", sa.Float),
        sa.Column("ttfb_ms", sa.Float),
        sa.Column("bytes", INTEGER),
        sa.Column("http_status", INTEGER),
        sa.Column("error", sa.Text),
        sa.Column("input_tokens", INTEGER),
        sa.Column("output_tokens", INTEGER),
        sa.Column("tokens_per_second", sa.Float),
        sa.Column("cancel_reason", sa.Text),
        sa.Column("job", sa.JSON),
    )
    op.create_index("ix_requests_status", "requests", ["status"])
    op.create_index("ix_requests_band_enqueued_at", "requests", ["band", "enqueued_at"])
    op.create_index("ix_requests_finished_at", "requests", ["finished_at"])
    op.create_index("ix_requests_idempotency_key", "requests", ["idempotency_key"])

    op.create_table(
        "processes",
        sa.Column("seq", INTEGER, primary_key=True, autoincrement=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("pid", INTEGER, nullable=False),
        sa.Column("cmdline", sa.JSON, nullable=False),
        sa.Column("port", INTEGER),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("stopped_at", sa.Float),
        sa.Column("stop_reason", sa.Text),
        sa.Column("exit_code", INTEGER),
    )
    op.create_index("ix_processes_pid", "processes", ["pid"])

    op.create_table(
        "swaps",
        sa.Column("seq", INTEGER, primary_key=True, autoincrement=False),
        sa.Column("from_model", sa.Text),
        sa.Column("to_model", sa.Text, nullable=False),
        sa.Column("request_id", sa.Text),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("finished_at", sa.Float),
        sa.Column("duration_ms", sa.Float),
        sa.Column("error", sa.Text),
    )
    op.create_index("ix_swaps_open", "swaps", ["to_model", "finished_at"])

    op.create_table(
        "projection_position",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("seq", INTEGER, nullable=False),
    )

    op.create_table(
        "job_results",
        sa.Column("request_id", sa.Text, primary_key=True),
        sa.Column("http_status", INTEGER, nullable=False),
        sa.Column("headers", sa.Text, nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.Column("stored_at", sa.Float, nullable=False),
    )
    op.create_index("ix_job_results_stored_at", "job_results", ["stored_at"])


def downgrade() -> None:
    for table in ("job_results", "projection_position", "swaps", "processes", "requests", "events"):
        op.drop_table(table)
