"""job bodies stored once, as bytes; the server lease (one log, one server)

`job_bodies` holds a durable job's request body as raw bytes, written before its
enqueue event; the event and `requests.job` keep only what is needed to replay
it (method, path, headers), so a large body is on disk once, not twice in base64.

`server_lease` is the one row saying which gpulane serves this log: the term
(raised at every take-over, recorded in the log as `lease_acquired`), who holds
it and until when. A second server refuses while the lease is live.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations import INTEGER

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_bodies",
        sa.Column("request_id", sa.Text, primary_key=True),
        sa.Column("stored_at", sa.Float, nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
    )
    op.create_table(
        "server_lease",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("term", INTEGER, nullable=False),
        sa.Column("holder", sa.Text, nullable=False),
        sa.Column("pid", INTEGER, nullable=False),
        sa.Column("host", sa.Text, nullable=False),
        sa.Column("listen", sa.Text, nullable=False),
        sa.Column("acquired_at", sa.Float, nullable=False),
        sa.Column("renewed_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("server_lease")
    op.drop_table("job_bodies")
