"""Damage SQLite does not see, read-only opening, and which errors are the file's.

The commands' sentences for damaged files are tested as a user meets them in
tests/e2e/test_damaged_database.py; these are the pieces underneath.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest
import sqlalchemy

from app.core.scoring import ScoringParams
from app.store import commands
from app.store.engine import DatabaseError, open_readonly, unusable
from app.store.event_store import read_events
from tools.replay.generate import SCENARIOS, generate_events, write_log


def _database(path: Path, days: int = 1) -> Path:
    """A gpulane database at `path` with a day of a synthetic workload, closed cleanly."""
    params = ScoringParams(aging_divisor_ns=60 * 10**9, swap_affinity_bonus=10)
    write_log(path, generate_events(SCENARIOS["fair"](1, days=days), params, label="fair"))
    return path


def _rewrite_schema(path: Path, old: bytes, new: bytes) -> None:
    """Change SQLite's copy of the schema in place, byte for byte, as damage does."""
    assert len(old) == len(new)
    data = path.read_bytes()
    assert data.count(old) == 1, old
    path.write_bytes(data.replace(old, new))


def test_open_readonly_of_a_self_contained_file_writes_nothing_beside_it(tmp_path: Path) -> None:
    db = _database(tmp_path / "copy.db")
    with contextlib.closing(sqlite3.connect(db)) as conn:
        events = conn.execute("SELECT count(*) FROM events").fetchone()[0]
    before = db.read_bytes()
    engine = open_readonly(db)
    try:
        assert len(list(read_events(engine))) == events
        with (
            pytest.raises(sqlalchemy.exc.OperationalError, match="readonly"),
            engine.begin() as conn,
        ):
            conn.exec_driver_sql("DELETE FROM events")
    finally:
        engine.dispose()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.db"]
    assert db.read_bytes() == before


def test_open_readonly_reads_the_commits_still_in_a_wal_beside_the_file(tmp_path: Path) -> None:
    # A live server's file: its last commits are in gpulane.db-wal, not yet in the file.
    db = _database(tmp_path / "gpulane.db")
    writer = sqlite3.connect(db, isolation_level=None)
    try:
        writer.execute("PRAGMA wal_autocheckpoint = 0")
        writer.execute("DELETE FROM events WHERE seq > 100")
        assert db.with_name("gpulane.db-wal").stat().st_size > 0
        engine = open_readonly(db)
        try:
            assert [seq for seq, _ in read_events(engine)] == list(range(1, 101))
        finally:
            engine.dispose()
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("old", "new", "found"),
    [
        (
            b"CREATE TABLE requests (\n\tid TEXT NOT NULL, \n\tmodel TEXT",
            b"CREATE TABLE requests (\n\tid TEXT NOT NULL, \n\tmodex TEXT",
            "column requests.model is missing",
        ),
        (b"AND +t.band = 'batch'", b"AND +t.band = 'botch'", "view wait_causes: its SQL"),
    ],
    ids=["a-column-renamed", "a-view-constant-changed"],
)
def test_db_check_finds_schema_damage_sqlite_does_not_see(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], old: bytes, new: bytes, found: str
) -> None:
    db = _database(tmp_path / "gpulane.db")
    _rewrite_schema(db, old, new)
    with contextlib.closing(sqlite3.connect(db)) as conn:  # SQLite finds nothing wrong
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert commands.check(str(db)) == 1
    captured = capsys.readouterr()
    assert found in captured.out
    assert f"{db}: the database file is corrupt" in captured.err
    assert "gpulane db backup" in captured.err


def test_db_check_of_a_whole_database_finds_no_schema_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = _database(tmp_path / "gpulane.db")
    assert commands.check(str(db)) == 0, capsys.readouterr()
    assert "schema:" not in capsys.readouterr().out


def test_only_errors_about_the_file_are_turned_into_its_sentence() -> None:
    path = "gpulane.db"
    damaged = unusable(path, sqlite3.DatabaseError("database disk image is malformed"))
    assert isinstance(damaged, DatabaseError)
    assert "gpulane.db: the database file is corrupt" in str(damaged)
    assert "gpulane db backup" in str(damaged)
    undecodable = unusable(path, _undecodable())
    assert undecodable is not None and "not UTF-8" in str(undecodable)
    older = unusable(path, sqlite3.OperationalError("no such table: job_bodies"))
    assert older is not None and "gpulane db upgrade --db gpulane.db" in str(older)
    # A constraint gpulane broke or a bug of its own keeps its traceback.
    assert unusable(path, sqlite3.IntegrityError("UNIQUE constraint failed")) is None
    assert unusable(path, ValueError("not about the file")) is None


def _undecodable() -> UnicodeDecodeError:
    try:
        b"CRE\xffTE".decode()
    except UnicodeDecodeError as exc:
        return exc
    raise AssertionError("decoded")
