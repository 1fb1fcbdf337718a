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


class _Sql:
    """The few functions whose spelling differs: SQLite's, or PostgreSQL's."""

    def __init__(self, dialect: str) -> None:
        self.pg = dialect == "postgresql"
        # Unix seconds now, with the fraction (unixepoch('subsec') needs SQLite 3.42).
        self.now = (
            "extract(epoch FROM now())::double precision"
            if self.pg
            else "((julianday('now') - 2440587.5) * 86400.0)"
        )
        self.max = "greatest" if self.pg else "max"
        self.min = "least" if self.pg else "min"

    def total(self, x: str) -> str:
        return f"coalesce(sum({x}), 0.0)" if self.pg else f"total({x})"

    def time(self, x: str) -> str:
        if self.pg:
            return f"to_char(to_timestamp({x}) AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')"
        return f"datetime({x}, 'unixepoch')"

    def hour(self, x: str) -> str:
        if self.pg:
            return f"to_char(to_timestamp({x}) AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:00')"
        return f"strftime('%Y-%m-%d %H:00', {x}, 'unixepoch')"

    def json(self, path: str, cast: str = "") -> str:
        """`data`'s value at `path` (`a.b`); `cast`: its type on PostgreSQL, whose
        `->>` answers text where SQLite's json_extract answers the JSON type."""
        if not self.pg:
            return f"json_extract(data, '$.{path}')"
        value = f"(CAST(data AS json) #>> '{{{path.replace('.', ',')}}}')"
        return f"CAST({value} AS {cast})" if cast else value

    def band(self, band: str) -> str:
        # The unary + keeps SQLite off the band index (see _behind); PostgreSQL has no + on text.
        return f"t.band = '{band}'" if self.pg else f"+t.band = '{band}'"

    def differs(self, x: str) -> str:
        """1 where `x` (an id) is not the winner, else 0, as an integer on both."""
        if self.pg:
            return f"coalesce(CAST({x} <> request_id AS integer), 0)"
        return f"coalesce({x} <> request_id, 0)"


def views(dialect: str) -> dict[str, str]:
    """The views' SQL on `dialect` ('sqlite' or 'postgresql')."""
    q = _Sql(dialect)
    # The wait of request w: arrival to dispatch, or to its end, or to now.
    w_end = f"coalesce(w.dispatched_at, w.finished_at, {q.now})"
    # Request t holds the GPU from dispatch to finish: its swap until it starts, then its run.
    t_end = f"coalesce(t.finished_at, {q.now})"
    t_run = f"coalesce(t.started_at, {t_end})"

    def overlap(start: str, end: str) -> str:
        return f"{q.max}(0.0, {q.min}({end}, {w_end}) - {q.max}({start}, w.enqueued_at))"

    def behind(where: str, start: str, end: str) -> str:
        """Seconds of w's wait during which requests matching `where` held [start, end).

        `t.finished_at > w.enqueued_at` walks ix_requests_finished_at, so the cost
        is the requests that finished after w arrived, not the whole table (the
        unary + in `+t.band` keeps SQLite off the band index, which would not be).
        """
        return (
            f"(SELECT {q.total(overlap(start, end))} FROM requests AS t "
            f"WHERE (t.finished_at > w.enqueued_at OR t.finished_at IS NULL) "
            f"AND t.dispatched_at < {w_end} AND t.id <> w.id AND {where})"
        )

    anything = "true" if q.pg else "1"
    return {
        "request_times": f"""
        SELECT id, model, band, priority, caller, endpoint, status, http_status, error,
               attempt, durable, enqueue_seq, enqueued_at, dispatched_at, started_at,
               finished_at,
               {q.time("enqueued_at")} AS enqueued,
               {q.hour("enqueued_at")} AS hour,
               queue_wait_ms / 1000.0 AS wait_s,
               swap_ms / 1000.0 AS swap_s,
               run_ms / 1000.0 AS run_s,
               finished_at - enqueued_at AS total_s
        FROM requests
        WHERE model IS NOT NULL
    """,
        "wait_causes": f"""
        SELECT w.id AS request_id,
               {behind(q.band("interactive"), t_run, t_end)} AS behind_interactive_s,
               {behind(q.band("normal"), t_run, t_end)} AS behind_normal_s,
               {behind(q.band("batch"), t_run, t_end)} AS behind_batch_s,
               {behind(anything, "t.dispatched_at", t_run)} AS swaps_s
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
        "decisions": f"""
        SELECT seq, at, {q.time("at")} AS time,
               {q.hour("at")} AS hour,
               request_id AS winner_id,
               {q.json("queue_depth", "bigint")} AS queue_depth,
               {q.json("resident")} AS resident,
               {q.json("winner.total", "double precision")} AS winner_score,
               {q.json("runner_up_id")} AS runner_up_id,
               {q.json("runner_up.total", "double precision")} AS runner_up_score,
               {q.differs(q.json("without_aging_id"))}
                   AS aging_changed,
               {q.differs(q.json("without_affinity_id"))}
                   AS affinity_changed
        FROM events
        WHERE type = 'scores_computed'
    """,
    }


VIEWS = views("sqlite")
"""The SQLite views, as every SQLite database has them (their text is checked)."""


def upgrade() -> None:
    for name, body in views(op.get_bind().dialect.name).items():
        op.execute(f"CREATE VIEW {name} AS {body.strip()}")


def downgrade() -> None:
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW IF EXISTS {name}")
