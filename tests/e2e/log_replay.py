"""What every gpulane log must allow: `gpulane replay DB --verify` passes, and
`explain` agrees with it (docs/replay.md, docs/queries.md "How explain works")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from app.report.explain import explain
from app.store.engine import open_database
from tests.e2e.gateway import REPO


def gpulane(*args: str) -> subprocess.CompletedProcess[str]:
    """The `gpulane` command line, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_log_replays(db: Path) -> int:
    """`replay --verify` passes on `db`; the story `explain` tells of every request
    recomputes each decision it saw as recorded, and together the stories see every
    decision (but those that dispatched an attempt re-queued since: a story starts at
    its request's last attempt). Returns the number of decisions."""
    run = gpulane("replay", str(db), "--verify")
    assert run.returncode == 0, run.stdout + run.stderr
    decisions = int(run.stdout.split()[1])
    engine = open_database(db, upgrade=False)
    try:
        with engine.connect() as conn:
            ids = [r[0] for r in conn.exec_driver_sql("SELECT id FROM requests ORDER BY id")]
            recorded: dict[int, str] = dict(
                conn.exec_driver_sql(
                    "SELECT seq, request_id FROM events WHERE type = 'scores_computed'"
                ).all()
            )
            requeued = conn.exec_driver_sql(
                "SELECT request_id, max(seq) FROM events WHERE type = 'request_requeued' "
                "GROUP BY request_id"
            ).all()
            restored = conn.exec_driver_sql(
                "SELECT request_id FROM events WHERE type = 'request_restored' "
                "ORDER BY seq DESC LIMIT 1"
            ).scalar()
        seen: set[int] = set()
        for request_id in ids:
            story = explain(engine, request_id)
            assert story is not None and story.replay_matches, (request_id, story)
            assert all(d.matches_record for d in story.decisions), story
            seen.update(d.seq for d in story.decisions)
    finally:
        engine.dispose()
    assert len(recorded) == decisions
    last_requeue: dict[str, int] = dict(requeued)
    unseen = {s for s in recorded if s not in seen}
    assert all(s < last_requeue.get(recorded[s], 0) for s in unseen), unseen
    if restored is not None:
        # And as a user asks it, for a job put back by a recovery.
        shown = gpulane("explain", restored, "--db", str(db), "--json")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["replay_matches"] is True
    return decisions
