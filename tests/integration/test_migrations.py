"""Alembic owns the schema, and what it builds is exactly what tables.py describes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from app import cli
from app.store import commands, migrate
from app.store.engine import create_engine, open_database
from app.store.queries import activity
from app.store.tables import metadata

REPO = Path(__file__).resolve().parents[2]


def _tables(engine: sqlalchemy.Engine) -> set[str]:
    return set(sqlalchemy.inspect(engine).get_table_names())


def test_upgrade_head_builds_exactly_the_metadata(tmp_path: Path) -> None:
    engine = open_database(tmp_path / "gpulane.db")
    with engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn), metadata)
    engine.dispose()
    assert diffs == []


def test_downgrade_base_then_upgrade_head(tmp_path: Path) -> None:
    engine = create_engine(tmp_path / "gpulane.db")
    migrate.upgrade_to_head(engine)
    assert set(metadata.tables) <= _tables(engine)
    migrate.downgrade_to_base(engine)
    assert _tables(engine) == {"alembic_version"}
    migrate.upgrade_to_head(engine)
    assert set(metadata.tables) <= _tables(engine)
    with engine.connect() as conn:
        assert migrate.current_revision(conn) == migrate.head_revision()
    engine.dispose()


OPEN_WHEN_TOLD = """
import os, sys, time
from app.store.engine import DatabaseError, open_database
db, go = sys.argv[1:]
print("ready", flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(go):
    if time.monotonic() > deadline:
        sys.exit("never told to go")
    time.sleep(0.001)
try:
    open_database(db).dispose()
    print("opened")
except DatabaseError as exc:
    print(exc)
"""
"""Imports first, then opens (and so migrates) the database once the file `go` exists."""


def test_two_processes_opening_a_new_database_at_once_both_migrate_it(
    tmp_path: Path, database: str
) -> None:
    """What was measured: two servers started at once on a SQLite file that did
    not exist yet raced in its migration, and one failed, "database is locked"
    (every round of this test did, before)."""
    rounds = 1 if "://" in database else 3  # one PostgreSQL database per test
    for round_ in range(rounds):
        db = database if "://" in database else str(tmp_path / f"round-{round_}.db")
        go = tmp_path / f"go-{round_}"
        both = [
            subprocess.Popen(
                [sys.executable, "-c", OPEN_WHEN_TOLD, db, str(go)],
                cwd=REPO,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in "ab"
        ]
        for process in both:
            assert process.stdout is not None and process.stdout.readline() == "ready\n"
        go.touch()
        answers = [process.communicate(timeout=60)[0].strip() for process in both]
        assert answers == ["opened", "opened"], answers
    engine = open_database(db)
    with engine.connect() as conn:
        assert migrate.current_revision(conn) == migrate.head_revision()
    engine.dispose()


def test_one_linear_history() -> None:
    scripts = ScriptDirectory.from_config(migrate.alembic_config())
    assert len(scripts.get_heads()) == 1
    assert scripts.get_base() == "0001"


def test_opening_twice_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "gpulane.db"
    open_database(path).dispose()
    engine = open_database(path)
    with engine.connect() as conn:
        assert migrate.current_revision(conn) == migrate.head_revision()
    engine.dispose()


def test_db_upgrade_runs_from_any_directory_without_alembic_ini(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["db", "upgrade", "--db", "new.db"]) == 0
    assert f"at schema revision {migrate.head_revision()}" in capsys.readouterr().out
    engine = create_engine(tmp_path / "new.db")
    assert set(metadata.tables) <= _tables(engine)
    engine.dispose()


def test_db_upgrade_refuses_an_unusable_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "notes.db"
    path.write_text("shopping list\n")
    assert commands.upgrade(str(path)) == 1
    assert f"{path}: not an SQLite database" in capsys.readouterr().err


@pytest.mark.parametrize("caller", [None, "alice"])
def test_newest_first_request_pages_read_an_index_not_the_whole_table(
    tmp_path: Path, caller: str | None
) -> None:
    # /v1/activity and /v1/jobs page newest first, often for one caller: on a
    # million requests a full scan and sort took about 1 s a page.

    engine = open_database(tmp_path / "gpulane.db")
    plans: list[str] = []

    @sqlalchemy.event.listens_for(engine, "before_cursor_execute")
    def explain(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if statement.lstrip().upper().startswith("SELECT") and "requests" in statement:
            rows = cursor.execute(f"EXPLAIN QUERY PLAN {statement}", parameters).fetchall()
            plans.append(" | ".join(str(r[-1]) for r in rows))

    activity(engine, limit=50, offset=0, caller=caller)
    engine.dispose()
    assert plans, "activity ran no query on requests"
    expected = "ix_requests_caller_enqueue_seq" if caller else "ix_requests_enqueue_seq"
    assert expected in plans[0]
    assert "TEMP B-TREE" not in plans[0]  # no sort of the whole table
