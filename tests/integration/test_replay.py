"""tools/replay against real SQLite files: generated logs, a real `gpulane serve`
session, a log whose order contradicts the score, and the command line as a user runs it."""

from __future__ import annotations

import concurrent.futures as cf
import csv
import hashlib
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.core import events as ev
from app.core.scoring import NS_PER_S, ScoringParams
from app.store import commands
from tests.e2e.gateway import REPO, Gateway, fake_model
from tools.replay.cli import replay_command
from tools.replay.generate import write_log

T0 = 1_700_000_000 * NS_PER_S


def replay(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.replay", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def digest(path: Path) -> dict[str, str]:
    """Hash of the database and of its -wal if any. (The -shm is SQLite's shared-memory
    index of the WAL, which every reader maintains; it holds no data.)"""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.parent.glob(path.name + "*"))
        if not p.name.endswith("-shm")
    }


@pytest.fixture(scope="module")
def film_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("replay") / "film.db"
    assert replay_command(["generate", "film", "--out", str(db), "--seed", "4"]) == 0
    return db


# -- generated logs ------------------------------------------------------------------


def test_generated_log_is_a_valid_gpulane_database(
    film_db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert commands.check(str(film_db)) == 0
    assert "ok:" in capsys.readouterr().out


def test_generated_log_verifies_from_the_command_line(film_db: Path) -> None:
    run = replay(str(film_db), "--verify")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("ok: ") and "decisions" in run.stdout


def test_report_json_has_recorded_row_first_then_grid_then_references(
    film_db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = digest(film_db)
    code = replay_command(
        [str(film_db), "--sweep", "aging=30,60", "bonus=0,10", "--json", "--jobs", "2"]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    labels = [r["label"] for r in out["runs"]]
    assert labels[0] == "recorded"
    assert "aging=60s bonus=10 (recorded)" in labels
    assert {"aging=30s bonus=0", "aging=30s bonus=10", "aging=60s bonus=0"} <= set(labels)
    assert labels[-3:] == ["arrival order", "priority, no aging", "fifo (x10)"]
    assert sum(r["best"] for r in out["runs"]) <= 1  # a * needs a gain beyond the noise
    recorded = out["runs"][0]
    assert recorded["kind"] == "recorded"
    assert recorded["bands"]["batch"]["count"] == 174
    assert recorded["swaps"] > 0
    assert out["chained"] >= 173
    assert digest(film_db) == before  # read-only


def test_report_csv_and_table(film_db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert replay_command([str(film_db), "--csv", "--no-reference", "--jobs", "1"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["label"] for r in rows] == ["recorded", "aging=60s bonus=10 (recorded)"]
    assert float(rows[0]["interactive_wait_p95_s"]) > 0
    assert (
        replay_command([str(film_db), "--aging-divisor", "30", "--shake", "2", "--jobs", "2"]) == 0
    )
    table = capsys.readouterr().out
    assert "aging=30s bonus=10" in table and "interactive" in table and "swaps" in table
    assert "spread over 2 shaken runs" in table


def test_plot_without_matplotlib_warns_and_still_reports(
    film_db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "replay.png"
    assert replay_command([str(film_db), "--no-reference", "--plot", str(png)]) == 0
    captured = capsys.readouterr()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib" in captured.err
        assert not png.exists()
    else:
        assert png.stat().st_size > 10_000


def test_unusable_inputs_fail_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert replay_command([str(tmp_path / "missing.db"), "--verify"]) == 1
    assert "no such database file" in capsys.readouterr().err
    text = tmp_path / "notes.db"
    text.write_text("not a database")
    assert replay_command([str(text)]) == 1
    assert "not an SQLite database" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        replay_command([str(text), "--sweep", "bonus=100"])
    assert exit_info.value.code == 2


# -- a log whose recorded order contradicts the score ------------------------------


def test_a_dispatch_that_contradicts_the_score_fails_verify(tmp_path: Path) -> None:
    db = tmp_path / "tampered.db"
    params = ScoringParams(60 * NS_PER_S, 10)

    def enqueued(rid: str, at_s: int, priority: int) -> ev.RequestEnqueued:
        return ev.RequestEnqueued(
            at=T0 + at_s * NS_PER_S,
            request_id=rid,
            model="A",
            model_requested="A",
            endpoint="/v1/chat/completions",
            priority=priority,
            band="normal" if priority == 0 else "interactive",
        )

    at = T0 + 10 * NS_PER_S
    # "low" (0) was dispatched although "high" (+100) waited too: the core picks "high".
    wrong = params.breakdown(0, T0 + 1 * NS_PER_S, at, False)
    write_log(
        db,
        [
            ev.ServerStarted(
                at=T0,
                version="test",
                config_hash="",
                scheduler="serial",
                aging_divisor_ns=params.aging_divisor_ns,
                swap_affinity_bonus=params.swap_affinity_bonus,
            ),
            enqueued("low", 1, 0),
            enqueued("high", 2, 100),
            ev.ScoresComputed(
                at=at,
                request_id="low",
                queue_depth=2,
                resident=None,
                winner=wrong,
                aging_divisor_ns=params.aging_divisor_ns,
                swap_affinity_bonus=10,
            ),
            ev.RequestDispatched(at=at, request_id="low", model="A", swap=True),
        ],
    )
    run = replay(str(db), "--verify")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "first divergence at seq 4" in run.stdout
    assert "recorded : low" in run.stdout and "simulated: high" in run.stdout
    assert "priority 100" in run.stdout and "priority 0" in run.stdout


# -- a real server's log ------------------------------------------------------------


def _config(aging_divisor: str, bonus: int) -> str:
    models = "".join(fake_model(m) for m in ("A", "B", "C")).replace("\n", "\n  ")
    return (
        "routing:\n  scheduler:\n    use: serial\n    settings:\n      serial:\n"
        f"        agingDivisor: {aging_divisor}\n        swapAffinityBonus: {bonus}\n"
        f"models:{models}\n"
    )


def test_a_real_serve_session_verifies(tmp_path: Path) -> None:
    # agingDivisor 0.05 s: a few tenths of a second of waiting is worth points, so
    # aging, affinity and priority all take part in the decisions.
    gw = Gateway(tmp_path, _config("0.05", 10)).start()
    try:
        mixed = [
            ("B", "batch"),
            ("A", None),
            ("C", "interactive"),
            ("A", "101"),
            ("B", "-99"),
            ("C", None),
            ("A", "interactive"),
            ("B", "2"),
        ]
        with cf.ThreadPoolExecutor(len(mixed) + 1) as pool, gw.client() as client:

            def post(model: str, priority: str | None, delay: float = 0.05) -> int:
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": "hi"}],
                    "fake": {"delay": delay},
                }
                headers = {"X-LlamaSwap-Priority": priority} if priority else {}
                return client.post("/v1/chat/completions", json=body, headers=headers).status_code

            blocker = pool.submit(post, "A", None, 1.2)  # holds the GPU while the rest queue
            time.sleep(0.3)
            futures = []
            for model, priority in mixed:
                futures.append(pool.submit(post, model, priority))
                time.sleep(0.05)
            assert blocker.result() == 200
            assert [f.result() for f in futures] == [200] * len(mixed)
        gw.wait_for("SELECT id FROM requests WHERE status = 'completed'", count=len(mixed) + 1)
    finally:
        gw.stop()
    before = digest(gw.db)
    run = replay(str(gw.db), "--verify")
    assert run.returncode == 0, run.stdout + run.stderr
    decisions = int(run.stdout.split()[1])
    assert decisions == len(mixed) + 1
    report = replay(str(gw.db), "--json", "--jobs", "1")
    assert report.returncode == 0, report.stderr
    recorded = json.loads(report.stdout)["runs"][0]
    assert recorded["swaps"] >= 3
    assert sum(b["count"] for b in recorded["bands"].values()) == len(mixed) + 1
    assert digest(gw.db) == before
