"""SIGKILL at random moments, over and over, on one database: no acknowledged
durable job is ever lost or completed twice."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from tests.e2e.gateway import Gateway, fake_model

ROUNDS = int(__import__("os").environ.get("CRASH_ROUNDS", "24"))


def test_random_sigkills_never_lose_or_duplicate_an_acknowledged_job(tmp_path: Path) -> None:
    # B loads slowly, so kills land during swaps too; jobs stream, so kills land mid-stream.
    models = (fake_model("A") + fake_model("B", "--start-delay", "0.3")).replace("\n", "\n  ")
    gw = Gateway(tmp_path, f"jobs:\n  maxAttempts: 1000\nmodels:{models}\n")
    rng = random.Random(20261129)
    acknowledged: list[str] = []
    lock = threading.Lock()

    def submit_some(stop: threading.Event) -> None:
        with httpx.Client(base_url=gw.url, timeout=5) as client:
            while not stop.is_set():
                body = {
                    "model": rng.choice("AB"),
                    "stream": rng.random() < 0.5,
                    "messages": [],
                    "fake": {"chunks": 4, "chunk_delay": rng.choice([0, 0.01, 0.03])},
                }
                priority = rng.choice(["interactive", "normal", "batch", "2", "-98"])
                try:
                    r = client.post(
                        "/v1/chat/completions",
                        json=body,
                        headers={"Prefer": "respond-async", "X-LlamaSwap-Priority": priority},
                    )
                except httpx.HTTPError:
                    return  # gpulane died under us: this one was never acknowledged
                if r.status_code == 202:
                    with lock:
                        acknowledged.append(r.json()["id"])
                time.sleep(0.05)  # a queue that can drain, so the runs interleave with kills

    for _ in range(ROUNDS):
        gw.start()
        stop = threading.Event()
        thread = threading.Thread(target=submit_some, args=(stop,))
        thread.start()
        time.sleep(rng.uniform(0.05, 0.6))
        gw.kill()
        stop.set()
        thread.join()

    gw.start()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        left = gw.sql("SELECT count(*) AS n FROM requests WHERE status IN ('queued','running')")
        if left[0]["n"] == 0:
            break
        time.sleep(0.2)
    gw.stop()

    assert len(acknowledged) > ROUNDS  # the loop really did work between kills
    rows = gw.sql("SELECT id, status FROM requests WHERE durable = 1")
    status = {r["id"]: r["status"] for r in rows}
    assert [j for j in acknowledged if status.get(j) != "completed"] == []
    completions = Counter(
        r["request_id"]
        for r in gw.sql("SELECT request_id FROM events WHERE type='request_completed'")
    )
    assert [j for j in acknowledged if completions[j] != 1] == []
    check = gw.db_check()
    assert check.returncode == 0, check.stdout + check.stderr
