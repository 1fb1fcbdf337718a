"""files and batches: the OpenAI Files and Batch APIs on durable jobs

`files` holds uploaded files (a batch's input) and a batch's output and error
files, whole, each written in one transaction. `batches` is a batch's own
state; `batch_lines` maps each input line (its custom_id) to the durable job
that answers it.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 01:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations import INTEGER

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("caller", sa.Text),
        sa.Column("purpose", sa.Text, nullable=False),
        sa.Column("filename", sa.Text, nullable=False),
        sa.Column("bytes", INTEGER, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("content", sa.LargeBinary, nullable=False),
    )
    op.create_index("ix_files_caller_created_at", "files", ["caller", "created_at"])
    op.create_table(
        "batches",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("caller", sa.Text),
        sa.Column("endpoint", sa.Text, nullable=False),
        sa.Column("input_file_id", sa.Text, nullable=False),
        sa.Column("completion_window", sa.Text, nullable=False),
        sa.Column("metadata", sa.JSON),
        sa.Column("priority", INTEGER, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("errors", sa.JSON),
        sa.Column("total", INTEGER, nullable=False),
        sa.Column("output_file_id", sa.Text),
        sa.Column("error_file_id", sa.Text),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
        sa.Column("in_progress_at", sa.Float),
        sa.Column("finalizing_at", sa.Float),
        sa.Column("completed_at", sa.Float),
        sa.Column("failed_at", sa.Float),
        sa.Column("expired_at", sa.Float),
        sa.Column("cancelling_at", sa.Float),
        sa.Column("cancelled_at", sa.Float),
    )
    op.create_index("ix_batches_caller_created_at", "batches", ["caller", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.Text, primary_key=True),
        sa.Column("line", INTEGER, primary_key=True),
        sa.Column("custom_id", sa.Text, nullable=False),
        sa.Column("model", sa.Text),
        sa.Column("request_id", sa.Text),
        sa.Column("error", sa.JSON),
    )
    op.create_index("ix_batch_lines_request_id", "batch_lines", ["request_id"])


def downgrade() -> None:
    op.drop_table("batch_lines")
    op.drop_table("batches")
    op.drop_table("files")
