"""Every SQL recipe in docs/queries.md, run against the database of a real run
(tests/e2e/realistic_run.py), checking its columns and a known answer."""

from __future__ import annotations

import contextlib
import math
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.realistic_run import Run, realistic_run

DOC = Path(__file__).resolve().parents[2] / "docs" / "queries.md"

Rows = list[dict[str, Any]]


def recipes() -> dict[str, str]:
    """Heading -> the ```sql block under it."""
    out: dict[str, str] = {}
    heading = ""
    for match in re.finditer(r"^### ([^\n]+)$|^```sql\n(.*?)^```", DOC.read_text(), re.M | re.S):
        if match.group(1):
            heading = match.group(1).strip()
        else:
            assert heading not in out, f"two queries under {heading!r}"
            out[heading] = match.group(2)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return realistic_run(tmp_path_factory)


def query(run: Run, sql: str) -> tuple[list[str], Rows]:
    uri = f"file:{run.db}?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
        conn.row_factory = sqlite3.Row
        cursor = conn.execute(sql)
        columns = [d[0] for d in cursor.description]
        return columns, [dict(row) for row in cursor.fetchall()]


def check_slowest(run: Run, rows: Rows) -> None:
    assert 0 < len(rows) <= 10
    assert [r["total_s"] for r in rows] == sorted((r["total_s"] for r in rows), reverse=True)
    by_id = {r["id"]: r for r in rows}
    r3 = by_id[run.ids["r3"]]  # the batch request: behind everyone, and a swap
    assert (r3["band"], r3["model"]) == ("batch", "C")
    assert r3["behind_normal_s"] > 0.5 and r3["behind_interactive_s"] > 0
    assert r3["swaps_s"] > 0 and r3["own_swap_s"] > 0 and r3["behind_batch_s"] == 0
    for r in rows:
        behind = r["behind_interactive_s"] + r["behind_normal_s"] + r["behind_batch_s"]
        assert math.isclose(behind + r["swaps_s"], r["wait_s"], abs_tol=0.05), r


def check_percentiles(run: Run, rows: Rows) -> None:
    n: dict[str, int] = {}
    for r in rows:
        n[r["band"]] = n.get(r["band"], 0) + r["n"]
        assert r["p50_s"] <= r["p90_s"] <= r["p99_s"] <= r["max_s"]
    # Every queued request (app/core/wait.py): the cancelled one waited until it was
    # cancelled; the rejected one never queued.
    assert n == {"interactive": 3, "normal": 6, "batch": 2}


def check_reorders(run: Run, rows: Rows) -> None:
    totals = [sum(r[c] for r in rows) for c in ("decisions", "aging_changed", "affinity_changed")]
    assert totals == [10, 1, 1]


def check_swaps(run: Run, rows: Rows) -> None:
    assert sum(r["swaps"] for r in rows) == 4
    assert sum(r["failed"] for r in rows) == 0
    assert all(r["seconds_lost"] > 0 and r["max_s"] >= r["avg_s"] for r in rows)


def check_timeline(run: Run, rows: Rows) -> None:
    assert [r["start"] for r in rows] == sorted(r["start"] for r in rows)
    runs = [r["request_id"] for r in rows if r["kind"] == "run"]
    order = ["blocker1", "r5", "r4", "r2", "r1", "r6", "r3", "blocker2", "r7", "r8"]
    assert runs == [run.ids[name] for name in order]
    swaps = [(r["model"], r["request_id"]) for r in rows if r["kind"] == "swap"]
    assert swaps == [
        ("A", run.ids["blocker1"]),
        ("B", run.ids["r1"]),
        ("C", run.ids["r3"]),
        ("A", run.ids["blocker2"]),
    ]


def check_callers(run: Run, rows: Rows) -> None:
    assert rows[0] == {**rows[0], "caller": "key#2", "batch_requests": 2, "completed": 2}
    assert len(rows) == 1


CHECKS: dict[str, tuple[list[str], Callable[[Run, Rows], None]]] = {
    "Slowest requests of the last hour, and what they waited for": (
        [
            "id",
            "band",
            "model",
            "status",
            "total_s",
            "wait_s",
            "behind_interactive_s",
            "behind_normal_s",
            "behind_batch_s",
            "swaps_s",
            "own_swap_s",
            "run_s",
        ],
        check_slowest,
    ),
    "Wait percentiles per band per hour": (
        ["hour", "band", "n", "p50_s", "p90_s", "p99_s", "max_s"],
        check_percentiles,
    ),
    "How often aging or swap affinity changed a pick": (
        ["hour", "decisions", "aging_changed", "affinity_changed", "changed_pct"],
        check_reorders,
    ),
    "Swaps per hour and the time lost to them": (
        ["hour", "swaps", "failed", "seconds_lost", "avg_s", "max_s"],
        check_swaps,
    ),
    "The GPU's dispatch timeline for a time window": (
        [
            "start",
            "seconds",
            "kind",
            "model",
            "band",
            "priority",
            "caller",
            "waited_s",
            "request_id",
            "error",
        ],
        check_timeline,
    ),
    "Which callers queued the most batch work": (
        ["caller", "batch_requests", "completed", "gpu_s", "waited_s"],
        check_callers,
    ),
}


def test_every_recipe_has_a_check() -> None:
    assert set(recipes()) == set(CHECKS)


@pytest.mark.parametrize("title", list(CHECKS))
def test_recipe(run: Run, title: str) -> None:
    columns, rows = query(run, recipes()[title])
    expected_columns, check = CHECKS[title]
    assert columns == expected_columns
    check(run, rows)
