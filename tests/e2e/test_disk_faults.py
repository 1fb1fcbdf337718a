"""Real disk faults under a running `gpulane serve`: a full disk (a small tmpfs)
and immutable database files (`chattr +i`).

What was measured before (issue 21): a durable job's terminal events could not
be written on a full disk, were logged as "events not stored" and dropped; the
job's view said `running` for good, it ran a second time after a restart, and
`replay --verify` failed while `db check` said ok. Now the refused events are
kept and written once the disk accepts them, nothing new is admitted or started
meanwhile (503 with Retry-After, /health says why), and every scenario ends with
`db check`, `replay --verify` and a served request.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.gateway import Gateway, fake_model, poll
from tests.e2e.log_replay import assert_log_replays

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="mounting a tmpfs and chattr +i need root (CI runs as root)"
)


def chat(delay: float = 0.0, hold_file: Path | None = None) -> dict[str, Any]:
    fake: dict[str, Any] = {"delay": delay}
    if hold_file is not None:
        fake["hold_file"] = str(hold_file)
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "fake": fake}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 6 MiB tmpfs: room for a database, and quickly filled."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path) -> Path:
    """Write a file until the disk is full; remove it to free the space."""
    filler = disk / "filler"
    with filler.open("wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    with contextlib.suppress(OSError), filler.open("ab") as f:  # the last bytes of a page
        for _ in range(4096):
            f.write(b"\0")
            f.flush()
    assert shutil.disk_usage(disk).free < 65536
    return filler


def gateway(tmp_path: Path, db: Path) -> Gateway:
    # No free-space reserve: these tests fill the disk under a job on purpose.
    config = "jobs:\n  minFreeDisk: 0\nmodels:" + fake_model("m").replace("\n", "\n  ")
    gw = Gateway(tmp_path, config)
    gw.db = db
    return gw


def dispatches(gw: Gateway, request_id: str) -> int:
    rows = gw.sql(
        "SELECT count(*) AS n FROM events WHERE type = 'request_dispatched' AND request_id = ?",
        request_id,
    )
    return int(rows[0]["n"])


def in_live_queue(client: httpx.Client, request_id: str) -> bool:
    """Whether the run loop holds `request_id` running or waiting (its live
    state, not the log)."""
    queue = client.get("/api/queue").json()
    return any(e["request_id"] == request_id for e in queue["running"] + queue["waiting"])


def on_disk(gw: Gateway, request_id: str) -> dict[str, Any]:
    """What the database file holds of a job's ending, read with plain SQL."""
    (row,) = gw.sql(
        "SELECT status,"
        " (SELECT count(*) FROM events WHERE type = 'request_completed' AND request_id = ?)"
        " AS completions,"
        " (SELECT count(*) FROM job_results WHERE request_id = ?) AS results"
        " FROM requests WHERE id = ?",
        request_id,
        request_id,
        request_id,
    )
    return dict(row)


def health_text(client: httpx.Client) -> str:
    """/health's text; '' while a connection is being closed (the server that
    waited for its disk hands its socket over)."""
    try:
        return client.get("/health").text
    except httpx.TransportError:
        return ""


def assert_log_whole_and_serving(gw: Gateway) -> None:
    check = gw.db_check()
    assert check.returncode == 0, check.stdout + check.stderr
    assert_log_replays(gw.db)


def test_a_full_disk_while_a_job_runs_loses_nothing_and_runs_nothing_twice(
    tmp_path: Path, small_disk: Path
) -> None:
    gw = gateway(tmp_path, small_disk / "gpulane.db").start()
    waiting: dict[str, httpx.Response] = {}
    try:
        with gw.client() as client:
            # The job runs until the test lets it end, so the sync request's enqueue
            # is the first write the full disk refuses, however slow this host is.
            release = tmp_path / "release-job"
            r = client.post(
                "/v1/chat/completions",
                json=chat(hold_file=release),
                headers={"Prefer": "respond-async"},
            )
            assert r.status_code == 202, r.text
            job = r.json()["id"]
            poll(lambda: client.get(f"/v1/jobs/{job}").json()["status"] == "running", "running")
            # Its load's events are on disk too (on a slow host they may still be
            # on their way when the job reads running): nothing more is written for
            # it until the test releases it.
            started = (
                "SELECT count(*) FROM events WHERE type = 'request_started' AND request_id = ?"
            )
            poll(lambda: gw.sql(started, job)[0][0] == 1, "the job sent to its upstream, on disk")

            filler = fill(small_disk)

            # Admitted before anything failed: its enqueue is the first refused write.
            def send() -> None:
                with gw.client() as c:
                    waiting["sync"] = c.post("/v1/chat/completions", json=chat())

            sender = threading.Thread(target=send)
            sender.start()
            health = poll(
                lambda: (h := client.get("/health")).status_code == 503 and h, "/health 503"
            )
            assert "full" in health.text and int(health.headers["Retry-After"]) >= 1
            refused = client.post("/v1/chat/completions", json=chat())
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "event_log_unavailable"
            assert "full" in refused.json()["error"]["message"]
            assert int(refused.headers["Retry-After"]) >= 1
            assert gw.proc is not None and gw.proc.poll() is None

            release.touch()
            # The disk stays full while the job ends: its answer came back, and its
            # result (which must be on disk before its completion is recorded)
            # is refused and retried. Nothing of the ending is on disk yet.
            refusal = f"the result of job {job} refused by the database"
            poll(lambda: refusal in gw.log.read_text(), "the job's result refused")
            assert client.get("/health").status_code == 503
            assert on_disk(gw, job) == {"status": "running", "completions": 0, "results": 0}
            assert in_live_queue(client, job)

            filler.unlink()  # space comes back: what was kept is written, in order
            done = {"status": "completed", "completions": 1, "results": 1}
            poll(lambda: on_disk(gw, job) == done, "the job's ending on disk")
            poll(lambda: client.get(f"/v1/jobs/{job}").json()["status"] == "completed", "done")
            result = client.get(f"/v1/jobs/{job}/result")
            assert result.status_code == 200, result.text
            answer_id = result.json()["id"]
            sender.join(30)
            assert waiting["sync"].status_code == 200, waiting["sync"].text
            assert client.get("/health").text == "OK"

        gw.kill()  # SIGKILL: the next start must not run the completed job again
        gw.start()
        with gw.client() as client:
            view = client.get(f"/v1/jobs/{job}").json()
            assert view["status"] == "completed"
            assert client.get(f"/v1/jobs/{job}/result").json()["id"] == answer_id
            assert dispatches(gw, job) == 1
            assert client.post("/v1/chat/completions", json=chat()).status_code == 200
    finally:
        gw.stop()
    assert_log_whole_and_serving(gw)


@pytest.mark.parametrize("stop", ["stopped", "killed"])
def test_a_restart_on_a_full_disk_waits_for_space_and_then_serves(
    tmp_path: Path, small_disk: Path, stop: str
) -> None:
    """A clean stop leaves no write-ahead log, so the restart cannot even open
    the file (SQLite: disk I/O error); a SIGKILL leaves it, so the restart opens
    the file and cannot take the lease (database or disk is full). Either way
    it used to exit 1; now it listens, says why, and serves once space returns."""
    gw = gateway(tmp_path, small_disk / "gpulane.db").start()
    try:
        with gw.client() as client:
            assert client.post("/v1/chat/completions", json=chat()).status_code == 200
        gw.stop() if stop == "stopped" else gw.kill()
        filler = fill(small_disk)

        # After SIGKILL the write-ahead log may still hold room for the lease, so
        # the restart can get as far as serving with a log that refuses writes:
        # the running server's own wait (503, /health says why). Either way it
        # listens, says why, and serves once space returns.
        waiting = ("event log cannot be opened", "event log cannot be written")
        gw.start(up=lambda health: health.startswith(waiting))
        with gw.client() as client:
            health = client.get("/health")
            assert health.status_code == 503
            assert "full" in health.text, health.text
            assert int(health.headers["Retry-After"]) >= 1
            refused = client.post("/v1/chat/completions", json=chat())
            assert refused.status_code in (503, 507), refused.text
            assert int(refused.headers["Retry-After"]) >= 1
            if health.text.startswith("event log cannot be opened"):
                assert "serving once it can" in health.text, health.text
                error = refused.json()["error"]
                assert error["code"] == "event_log_unavailable" and "full" in error["message"]
                # Still waiting a few tries later (it tries every second).
                poll(lambda: "event log cannot be opened" in gw.log.read_text(), "logged")
            else:
                assert stop == "killed", health.text  # a clean stop leaves no room
            assert gw.proc is not None and gw.proc.poll() is None

            filler.unlink()
            freed = time.monotonic()
            poll(lambda: health_text(client) == "OK", "/health OK once space returns")
            print(f"serving {time.monotonic() - freed:.2f} s after space returned ({stop})")
            assert client.post("/v1/chat/completions", json=chat()).status_code == 200
    finally:
        gw.stop()
    assert gw.proc is not None and gw.proc.returncode == 0
    assert_log_whole_and_serving(gw)


def test_a_server_waiting_for_its_disk_ignores_sighup_and_stops_on_sigterm(
    tmp_path: Path, small_disk: Path
) -> None:
    gw = gateway(tmp_path, small_disk / "gpulane.db").start()
    gw.stop()
    fill(small_disk)
    gw.start(up=lambda health: health.startswith("event log cannot be opened"))
    assert gw.proc is not None
    try:
        gw.proc.send_signal(signal.SIGHUP)
        poll(lambda: "SIGHUP ignored" in gw.log.read_text(), "SIGHUP logged")
        with gw.client() as client:
            assert client.get("/health").status_code == 503
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(10) == 0
    finally:
        gw.stop()


def test_immutable_database_files_while_a_request_runs(tmp_path: Path) -> None:
    """`chattr +i` on every database file while a request runs: the client still
    gets its answer, and its completion, refused while the files are immutable,
    is kept and written once they are writable again (it was dropped before)."""
    gw = gateway(tmp_path, tmp_path / "gpulane.db").start()
    files = [gw.db, Path(f"{gw.db}-wal"), Path(f"{gw.db}-shm")]
    answer: dict[str, httpx.Response] = {}
    # The request runs until the files are immutable (a fixed run could end
    # before `chattr` on a slow host, its completion written in time).
    release = tmp_path / "release"
    try:
        with gw.client() as client:

            def send() -> None:
                with gw.client() as c:
                    answer["r"] = c.post("/v1/chat/completions", json=chat(hold_file=release))

            sender = threading.Thread(target=send)
            sender.start()
            poll(lambda: gw.sql("SELECT 1 FROM events WHERE type = 'request_started'"), "start")
            locked = subprocess.run(["chattr", "+i", *map(str, files)], capture_output=True)
            release.touch()
            if locked.returncode != 0:
                pytest.skip(f"chattr +i refused here: {locked.stderr.decode().strip()}")
            try:
                sender.join(30)
                assert answer["r"].status_code == 200, answer["r"].text
                health = poll(
                    lambda: (h := client.get("/health")).status_code == 503 and h, "/health 503"
                )
                assert "cannot be written" in health.text
                assert client.post("/v1/chat/completions", json=chat()).status_code == 503
            finally:
                subprocess.run(["chattr", "-i", *map(str, files)], check=True)
            poll(lambda: client.get("/health").text == "OK", "/health OK again")
            poll(
                lambda: gw.sql("SELECT 1 FROM requests WHERE status = 'completed'"),
                "the completion on disk",
            )
            assert gw.proc is not None and gw.proc.poll() is None
            assert client.post("/v1/chat/completions", json=chat()).status_code == 200
    finally:
        gw.stop()
    assert_log_whole_and_serving(gw)
