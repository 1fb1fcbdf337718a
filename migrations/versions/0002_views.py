"""SQL views for people: request_times, wait_causes, gpu_timeline, decisions

Read-only conveniences over the read models and the log, used by the recipes
in docs/queries.md (a test runs every one of them). Views hold no data, so
adding or changing one never needs a rebuild.

Revision ID: 0002
Revises: 0001
Create Date: 2025-01-02 00:00:00
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Unix seconds now, with the fraction (unixepoch('subsec') needs SQLite 3.42).
_NOW = "((julianday('now') - 2440587.5) * 86400.0)"

# The wait of request w: arrival to dispatch, or to its end, or to now.
_W_END = f"coalesce(w.dispatched_at, w.finished_at, {_NOW})"
# Request t holds the GPU from dispatch to finish: its swap until it starts, then its run.
_T_END = f"coalesce(t.finished_at, {_NOW})"
_T_RUN = f"coalesce(t.started_at, {_T_END})"


def _overlap(start: str, end: str) -> str:
    return f"max(0.0, min({end}, {_W_END}) - max({start}, w.enqueued_at))"


def _behind(where: str, start: str, end: str) -> str:
    """Seconds of w's wait during which requests matching `where` held [start, end).

    `t.finished_at > w.enqueued_at` walks ix_requests_finished_at, so the cost
    is the requests that finished after w arrived, not the whole table (the
    unary + in `+t.band` keeps SQLite off the band index, which would not be).
    """
    return (
        f"(SELECT total({_overlap(start, end)}) FROM requests AS t "
        f"WHERE (t.finished_at > w.enqueued_at OR t.finished_at IS NULL) "
        f"AND t.dispatched_at < {_W_END} AND t.id <> w.id AND {where})"
    )


VIEWS = {
    "request_times": """
        SELECT id, model, band, priority, caller, endpoint, status, http_status, error,
               attempt, durable, enqueue_seq, enqueued_at, dispatched_at, started_at,
               finished_at,
               datetime(enqueued_at, 'unixepoch') AS enqueued,
               strftime('%Y-%m-%d %H:00', enqueued_at, 'unixepoch') AS hour,
               queue_wait_ms / 1000.0 AS wait_s,
               swap_ms / 1000.0 AS swap_s,
               run_ms / 1000.0 AS run_s,
               finished_at - enqueued_at AS total_s
        FROM requests
        WHERE model IS NOT NULL
    """,
    "wait_causes": f"""
        SELECT w.id AS request_id,
               {_behind("+t.band = 'interactive'", _T_RUN, _T_END)} AS behind_interactive_s,
               {_behind("+t.band = 'normal'", _T_RUN, _T_END)} AS behind_normal_s,
               {_behind("+t.band = 'batch'", _T_RUN, _T_END)} AS behind_batch_s,
               {_behind("1", "t.dispatched_at", _T_RUN)} AS swaps_s
        FROM requests AS w
        WHERE w.model IS NOT NULL
    """,
    "gpu_timeline": """
        SELECT 'swap' AS kind, s.started_at AS start_at, s.finished_at AS end_at,
               s.finished_at - s.started_at AS seconds, s.to_model AS model,
               s.from_model AS from_model, s.request_id AS request_id, r.band AS band,
               r.priority AS priority, r.caller AS caller, NULL AS wait_s, s.error AS error
        FROM swaps AS s LEFT JOIN requests AS r ON r.id = s.request_id
        UNION ALL
        SELECT 'run', r.started_at, r.finished_at, r.finished_at - r.started_at, r.model,
               NULL, r.id, r.band, r.priority, r.caller, r.queue_wait_ms / 1000.0, r.error
        FROM requests AS r
        WHERE r.started_at IS NOT NULL
    """,
    "decisions": """
        SELECT seq, at, datetime(at, 'unixepoch') AS time,
               strftime('%Y-%m-%d %H:00', at, 'unixepoch') AS hour,
               request_id AS winner_id,
               json_extract(data, '$.queue_depth') AS queue_depth,
               json_extract(data, '$.resident') AS resident,
               json_extract(data, '$.winner.total') AS winner_score,
               json_extract(data, '$.runner_up_id') AS runner_up_id,
               json_extract(data, '$.runner_up.total') AS runner_up_score,
               coalesce(json_extract(data, '$.without_aging_id') <> request_id, 0)
                   AS aging_changed,
               coalesce(json_extract(data, '$.without_affinity_id') <> request_id, 0)
                   AS affinity_changed
        FROM events
        WHERE type = 'scores_computed'
    """,
}


def upgrade() -> None:
    for name, body in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {body.strip()}")


def downgrade() -> None:
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW IF EXISTS {name}")
