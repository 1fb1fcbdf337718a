"""indexes for the newest-first request lists: all callers' and one caller's

`/v1/activity` and `/v1/jobs` list requests newest first
(`ORDER BY enqueue_seq DESC LIMIT n`), often for one caller only. Without an index
SQLite reads and sorts the whole table for each page; with these it reads n rows.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 00:00:00
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_requests_enqueue_seq", "requests", ["enqueue_seq"])
    op.create_index("ix_requests_caller_enqueue_seq", "requests", ["caller", "enqueue_seq"])


def downgrade() -> None:
    op.drop_index("ix_requests_caller_enqueue_seq", "requests")
    op.drop_index("ix_requests_enqueue_seq", "requests")
