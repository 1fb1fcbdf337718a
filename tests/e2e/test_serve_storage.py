"""`gpulane serve` refuses a database it cannot write, instead of serving unrecorded.

What was measured before: with the file locked by another writer gpulane logged
"listening" and lost that run's server_started and recovery events; with an
immutable file /health answered 200 and every request 503.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.store.engine import STARTUP_WRITE_WAIT_S
from tests.e2e.gateway import REPO, Gateway, fake_model, free_port, free_port_block

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def gpulane(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def database(tmp_path: Path) -> Path:
    """A gpulane database created as a user creates one, and a config to serve it."""
    db = tmp_path / "gpulane.db"
    created = gpulane("db", "upgrade", "--db", str(db))
    assert created.returncode == 0, created.stderr
    models = fake_model("m").replace("\n", "\n  ")
    (tmp_path / "config.yaml").write_text(f"startPort: {free_port_block()}\nmodels:{models}\n")
    return db


def serve(db: Path) -> subprocess.CompletedProcess[str]:
    """Run `gpulane serve` to its end; it must exit on its own, refusing the file."""
    return gpulane(
        "serve",
        "--config",
        str(db.parent / "config.yaml"),
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--db",
        str(db),
    )


def events(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT count(*) FROM events").fetchone()[0])


def test_a_database_locked_by_another_writer_stops_serve_after_a_bounded_wait(
    database: Path,
) -> None:
    locker = sqlite3.connect(database, isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")  # as an open `sqlite3` shell transaction holds it
    try:
        result = serve(database)
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert result.returncode == 1, result.stdout + result.stderr
    assert str(database) in result.stderr
    assert "locked by another writer" in result.stderr
    assert f"gave up after {STARTUP_WRITE_WAIT_S:g} s" in result.stderr
    assert "listening" not in result.stdout + result.stderr
    assert events(database) == 0


@pytest.fixture
def unwritable(database: Path) -> Iterator[Path]:
    """The database made unwritable in a way that holds for the user running the tests.

    chmod 0444 stops an ordinary user; root ignores file modes, so as root the
    file is made immutable (chattr +i), which stops root too.
    """
    if os.geteuid() != 0:
        database.chmod(0o444)
        yield database
        database.chmod(0o644)
        return
    made = subprocess.run(["chattr", "+i", str(database)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(
            "running as root, where chmod 0444 does not stop writes, and chattr +i "
            f"failed here ({made.stderr.strip()}): no honest way to make the file unwritable"
        )
    try:
        yield database
    finally:
        subprocess.run(["chattr", "-i", str(database)], check=True)


def test_a_read_only_or_immutable_database_stops_serve_with_a_message(unwritable: Path) -> None:
    result = serve(unwritable)
    assert result.returncode == 1, result.stdout + result.stderr
    assert str(unwritable) in result.stderr
    assert "cannot be written" in result.stderr
    assert "readonly database" in result.stderr  # SQLite's own words
    assert "listening" not in result.stdout + result.stderr
    assert events(unwritable) == 0


def test_after_a_clean_stop_the_db_file_alone_is_complete(
    gateway: Callable[[str], Gateway], tmp_path: Path
) -> None:
    gw = gateway("models:" + fake_model("m").replace("\n", "\n  ") + "\n")
    with gw.client() as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    gw.stop()  # SIGTERM, as a service manager stops it (uvicorn re-raises it once done)
    wal = gw.db.with_name(gw.db.name + "-wal")
    assert not wal.exists() or wal.stat().st_size == 0

    copy = tmp_path / "copied" / "gpulane.db"
    copy.parent.mkdir()
    shutil.copyfile(gw.db, copy)  # the .db alone
    with sqlite3.connect(copy) as conn:
        types = {t for (t,) in conn.execute("SELECT type FROM events")}
        statuses = [s for (s,) in conn.execute("SELECT status FROM requests")]
    assert {"server_started", "request_enqueued", "request_completed"} <= types
    assert statuses == ["completed"]
    assert gpulane("db", "check", "--db", str(copy)).returncode == 0
