"""One realistic run of `gpulane serve`, shared by the explain and SQL-recipe tests.

Two server processes on one database. The first (swap affinity 10, aging one
point per minute) gets, while a long job holds model A:

    r1 B normal   r2 A normal   r3 C batch (key#2)   r4 A interactive
    r5 A 101      r6 B normal   a C request whose client gives up (cancelled)
    and a request for an unknown model (rejected)

and serves them r5 r4 r2 r1 r6 r3: band, then tier, then r2 by swap affinity
(the one pick affinity changes), r1 before r6 by arrival, r6 before r3 by band.
The second (affinity 0, aging 0.004 s per point) gets, behind another long job,
r7 A batch (key#2) then 0.9 s later r8 A interactive, and serves r7 first by
aging (the one pick aging changes). While r7 and r8 wait, the live queue and
r8's explanation are fetched over HTTP and with `gpulane queue`.

Swaps: A, A->B (r1), B->C (r3) in the first process; A in the second.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import io
import random
import socket
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from app import cli
from tests.e2e.gateway import Gateway, fake_model

KEYS = ("alice-key", "batch-key")
"""Callers key#1 and key#2."""


def free_port_block(n: int) -> int:
    """The first of n consecutive free ports below the ephemeral range, where the
    gateway's own client sockets cannot take an upstream's port mid-run."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 30000)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports")


def config(aging_divisor: float, bonus: int) -> str:
    models = "".join(fake_model(m) for m in ("A", "B", "C")).replace("\n", "\n  ")
    return (
        f"startPort: {free_port_block(3)}\n"
        "apiKeys:\n"
        + "".join(f"  - {k}\n" for k in KEYS)
        + "routing:\n  scheduler:\n    use: serial\n    settings:\n      serial:\n"
        + f"        agingDivisor: {aging_divisor}\n        swapAffinityBonus: {bonus}\n"
        + "models:"
        + models
        + "\n"
    )


@dataclass
class Run:
    db: Path
    ids: dict[str, str] = field(default_factory=dict)
    """Name in the docstring -> request id (blocker1, blocker2, r1..r8, cancelled, rejected)."""
    live_queue: dict[str, Any] = field(default_factory=dict)
    live_explain_r8: dict[str, Any] = field(default_factory=dict)
    live_queue_text: str = ""
    http_explain_r1: dict[str, Any] = field(default_factory=dict)
    http_explain_missing: int = 0


def _post(client: httpx.Client, model: str, priority: str | None, key: int, **fake: Any) -> Any:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if fake:
        body["fake"] = fake
    headers = {"Authorization": f"Bearer {KEYS[key - 1]}"}
    if priority is not None:
        headers["X-LlamaSwap-Priority"] = priority
    return client.post("/v1/chat/completions", json=body, headers=headers)


def _request_id(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.headers["x-request-id"])


def _wait_queued(gw: Gateway, count: int) -> None:
    """Until `count` requests are queued: each is enqueued before the next is sent."""
    rows = gw.wait_for("SELECT id FROM requests WHERE status = 'queued'", count=count)
    assert len(rows) >= count, "a request was not queued in time"


def _wait_started(gw: Gateway) -> None:
    """Until the long job runs on its loaded model: what is sent next waits for it,
    with A resident."""
    rows = gw.wait_for(
        "SELECT id FROM requests WHERE status = 'running' AND started_at IS NOT NULL"
    )
    assert rows, "the long job did not start in time"


def _phase1(gw: Gateway, run: Run) -> None:
    plan = [
        ("r1", "B", None, 1),
        ("r2", "A", None, 1),
        ("r3", "C", "batch", 2),
        ("r4", "A", "interactive", 1),
        ("r5", "A", "101", 1),
        ("r6", "B", None, 1),
    ]
    release = gw.tmp / "release-blocker1"
    with cf.ThreadPoolExecutor(len(plan) + 1) as pool, gw.client() as client:
        # At least 1.8 s, and until every request below was sent: a fixed run
        # could end first on a slow host.
        blocker = pool.submit(_post, client, "A", None, 1, delay=1.8, hold_file=str(release))
        try:
            _wait_started(gw)
            futures = {}
            for count, (name, model, priority, key) in enumerate(plan, start=1):
                futures[name] = pool.submit(_post, client, model, priority, key)
                _wait_queued(gw, count)
            with (
                pytest.raises(httpx.ReadTimeout),
                httpx.Client(base_url=gw.url, timeout=0.2) as impatient,
            ):
                _post(impatient, "C", None, 2)
            # Its cancel is on disk before the queue moves (the docstring's order).
            assert gw.wait_for("SELECT id FROM requests WHERE status = 'cancelled'")
            assert _post(client, "nope", None, 1).status_code == 404
        finally:
            release.touch()
        run.ids["blocker1"] = _request_id(blocker.result())
        for name, future in futures.items():
            run.ids[name] = _request_id(future.result())


def _phase2(gw: Gateway, run: Run) -> None:
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    release = gw.tmp / "release-blocker2"
    with cf.ThreadPoolExecutor(3) as pool, gw.client() as client:
        # At least 2 s, and until the live queue was read: a fixed run could end
        # first on a slow host.
        blocker = pool.submit(_post, client, "A", None, 1, delay=2.0, hold_file=str(release))
        try:
            _wait_started(gw)
            r7 = pool.submit(_post, client, "A", "batch", 2)
            _wait_queued(gw, 1)
            time.sleep(0.9)  # r7's age, the point of this phase (0.9 s = 225 points)
            r8 = pool.submit(_post, client, "A", "interactive", 1)
            _wait_queued(gw, 2)
            run.live_queue = client.get("/api/queue", headers=auth).json()
            waiting = [w["request_id"] for w in run.live_queue["waiting"]]
            if len(waiting) == 2:
                run.live_explain_r8 = client.get(
                    f"/api/requests/{waiting[1]}/explain", headers=auth
                ).json()
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                cli.main(["queue", "--url", gw.url, "--api-key", KEYS[0]])
            run.live_queue_text = out.getvalue()
        finally:
            release.touch()
        run.ids["blocker2"] = _request_id(blocker.result())
        run.ids["r7"] = _request_id(r7.result())
        run.ids["r8"] = _request_id(r8.result())
        gw.wait_for("SELECT id FROM requests WHERE id = ? AND status = 'completed'", run.ids["r8"])
        run.http_explain_r1 = client.get(
            f"/api/requests/{run.ids['r1']}/explain", headers=auth
        ).json()
        run.http_explain_missing = client.get(
            "/api/requests/no-such-request/explain", headers=auth
        ).status_code


_RUNS: dict[str, Run] = {}


def realistic_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The run, made once per test session (both test modules share it)."""
    if "run" in _RUNS:
        return _RUNS["run"]
    tmp = tmp_path_factory.mktemp("realistic_run")
    run = Run(db=tmp / "gpulane.db")
    for phase, text in ((_phase1, config(60, 10)), (_phase2, config(0.004, 0))):
        gw = Gateway(tmp, text).start()
        try:
            phase(gw, run)
        finally:
            gw.stop()
    with contextlib.closing(sqlite3.connect(run.db)) as conn:
        rows = conn.execute(
            "SELECT id, status, model FROM requests WHERE status IN ('cancelled', 'failed')"
        ).fetchall()
    for request_id, status, model in rows:
        run.ids["rejected" if model is None else status] = request_id
    _RUNS["run"] = run
    return run
