"""A damaged database gets a sentence, and `gpulane ui --db` reads a copy without writing.

What was measured before (issue 21, item 2): one byte of the schema that was not
UTF-8 gave a raw UnicodeDecodeError traceback from `db check`, `serve`, `ui` and
`replay`; a damaged data page let `serve` start and `db backup` copy the damage
with "ok"; `ui --db COPY` created `-wal`/`-shm` beside the copy and, in a
read-only directory, failed with "file is corrupt or not an SQLite database".

Every damage here is made on a copy of a database a real gpulane served, and
every command is run as a user runs it.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.e2e.gateway import REPO, Gateway, fake_model, free_port, free_port_block

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
PAGE_SIZE = 4096  # SQLite's default, which gpulane keeps


def gpulane(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The `gpulane` command of this environment, as a user runs it."""
    script = Path(sys.executable).with_name("gpulane")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "app.cli"]
    return subprocess.run(
        [*command, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A `gpulane db backup` copy of a database a real gpulane served, and the id
    of one request in it."""
    tmp = tmp_path_factory.mktemp("served")
    gw = Gateway(tmp, "models:" + fake_model("m").replace("\n", "\n  ") + "\n").start()
    try:
        with gw.client() as client:
            ids = []
            for _ in range(30):  # events enough for several pages of the log
                response = client.post("/v1/chat/completions", json=CHAT)
                assert response.status_code == 200, response.text
                ids.append(response.headers["x-request-id"])
        copy = tmp / "copy.db"
        made = gpulane("db", "backup", str(copy), "--db", str(gw.db))
        assert made.returncode == 0, made.stderr
    finally:
        gw.stop()
    whole = gpulane("db", "check", "--db", str(copy))  # the damage is all that fails below
    assert whole.returncode == 0, whole.stdout + whole.stderr
    return copy, ids[len(ids) // 2]


# -- the damages -------------------------------------------------------------------


def schema_byte(data: bytes, _request_id: str) -> bytes:
    """The measured case: one byte of SQLite's copy of the schema (sqlite_master's
    SQL text) that is not UTF-8, in a keyword, so SQLite's error quotes it."""
    at = data.find(b"CREATE TABLE events")
    assert at > 0 and data.count(b"CREATE TABLE events") == 1
    damaged = bytearray(data)
    damaged[at + len("CRE")] = 0xFF
    return bytes(damaged)


def data_page(data: bytes, request_id: str) -> bytes:
    """Garbage over the page of the log that holds the request's first event."""
    at = data.find(f'"request_id":"{request_id}"'.encode())
    assert at > PAGE_SIZE
    page = at // PAGE_SIZE
    garbage = random.Random(21).randbytes(PAGE_SIZE)
    return data[: page * PAGE_SIZE] + garbage + data[(page + 1) * PAGE_SIZE :]


def truncated(data: bytes, _request_id: str) -> bytes:
    """Cut short, as a copy interrupted or a disk that filled up leaves it."""
    return data[: len(data) // 2]


def not_sqlite(_data: bytes, _request_id: str) -> bytes:
    """Another file where the database should be."""
    return b"models:\n  m:\n    cmd: llama-server --port ${PORT}\n" * 100


DAMAGES = [schema_byte, data_page, truncated, not_sqlite]

COMMANDS: dict[str, Callable[[Path, str], list[str]]] = {
    "db check": lambda db, _: ["db", "check", "--db", str(db)],
    "db backup": lambda db, _: ["db", "backup", str(db.with_name("backup.db")), "--db", str(db)],
    "explain": lambda db, rid: ["explain", rid, "--db", str(db)],
    "serve": lambda db, _: [
        "serve",
        "--config",
        str(db.with_name("config.yaml")),
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--db",
        str(db),
    ],
    "ui": lambda db, _: ["ui", "--db", str(db), "--port", str(free_port())],
    "replay --verify": lambda db, _: ["replay", str(db), "--verify"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("damage", DAMAGES, ids=lambda d: d.__name__)
def test_a_damaged_database_gets_a_sentence_from_every_command(
    served: tuple[Path, str],
    tmp_path: Path,
    damage: Callable[[bytes, str], bytes],
    command: str,
) -> None:
    copy, request_id = served
    db = tmp_path / "gpulane.db"
    db.write_bytes(damage(copy.read_bytes(), request_id))
    before = db.read_bytes()
    models = fake_model("m").replace("\n", "\n  ")
    db.with_name("config.yaml").write_text(f"startPort: {free_port_block()}\nmodels:{models}\n")

    # serve and ui would run until stopped: each must refuse the file and exit.
    result = gpulane(*COMMANDS[command](db, request_id))

    said = result.stdout + result.stderr
    assert result.returncode == 1, said
    assert "Traceback" not in said
    assert str(db) in result.stderr  # the file
    assert "corrupt" in result.stderr or "not an SQLite database" in result.stderr  # what
    assert "gpulane db backup" in result.stderr  # what to do
    assert "gpulane db check" in result.stderr
    assert "listening" not in said and "http://" not in result.stdout
    assert db.read_bytes() == before  # nothing written into it
    assert not db.with_name("backup.db").exists()  # no copy of the damage


# -- gpulane ui --db: read-only for real --------------------------------------------


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_ui_reads_a_backup_copy_in_a_read_only_directory_and_writes_nothing_beside_it(
    served: tuple[Path, str], tmp_path: Path
) -> None:
    """Where the directory cannot be made read-only (root, and chattr refused), the
    test still shows that nothing was created beside the copy."""
    copy, request_id = served
    directory = tmp_path / "copies"
    directory.mkdir()
    db = directory / "gpulane.db"
    db.write_bytes(copy.read_bytes())
    _read_only(directory)
    try:
        read_only = _cannot_create_in(directory)
        answers = _ui_answers(db, request_id)
        beside = sorted(p.name for p in directory.iterdir())
    finally:
        _writable(directory)
    assert answers == {"timeline": 200, "explain": request_id}
    assert beside == ["gpulane.db"], f"created beside the copy (read-only: {read_only})"
    assert digest(db) == digest(copy)


def _read_only(directory: Path) -> None:
    directory.chmod(0o555)
    if os.geteuid() == 0:  # root ignores modes; an immutable directory stops root too
        subprocess.run(["chattr", "+i", str(directory)], capture_output=True)


def _writable(directory: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(directory)], capture_output=True)
    directory.chmod(0o755)


def _cannot_create_in(directory: Path) -> bool:
    probe = directory / "probe"
    try:
        probe.touch()
    except OSError:
        return True
    probe.unlink()
    return False


def _ui_answers(db: Path, request_id: str) -> dict[str, object]:
    """Run `gpulane ui --db`, read a page, the timeline and a story, stop it."""
    port = free_port()
    script = Path(sys.executable).with_name("gpulane")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "app.cli"]
    proc = subprocess.Popen(
        [*command, "ui", "--db", str(db), "--port", str(port)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=30) as client:  # a loaded host is slow
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, proc.communicate()[0].decode()
                try:
                    page = client.get("/ui/")
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, "gpulane ui did not answer"
                    time.sleep(0.05)
            assert page.status_code == 200
            timeline = client.get("/ui/api/timeline")
            story = client.get(f"/api/requests/{request_id}/explain")
            assert story.status_code == 200, story.text
            return {"timeline": timeline.status_code, "explain": story.json()["request_id"]}
    finally:
        proc.terminate()
        output = proc.communicate(timeout=15)[0].decode()
        assert "Traceback" not in output
