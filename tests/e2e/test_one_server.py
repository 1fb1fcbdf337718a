"""One log, one server: a second `gpulane serve` on a database another live gpulane
serves refuses to start and touches nothing; a killed one never blocks a restart;
a server whose lease another took over stops without writing.

What was measured before: the second server started, its recovery stopped the
first one's upstream as a leftover, it answered a chat itself, and the first
one's next request got 502.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from app.store.lease import RENEW_EVERY_S
from app.web.serve import FENCED_EXIT
from tests.e2e.gateway import (
    REPO,
    Gateway,
    fake_model,
    free_port,
    free_port_block,
    poll,
    upstreams_alive,
    upstreams_left,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def config(first_port: int, extra: str = "") -> str:
    models = fake_model("m").replace("\n", "\n  ")
    return f"{extra}startPort: {first_port}\nmodels:{models}\n"


# A lease far longer than a restart on a loaded host: the restart must take it
# because its holder is gone, never because it expired meanwhile.
LONG_LEASE_S = 120
LONG_LEASE = f"database: {{leaseSeconds: {LONG_LEASE_S}}}\n"


def leases(gw: Gateway) -> list[dict[str, object]]:
    rows = gw.sql("SELECT data FROM events WHERE type = 'lease_acquired' ORDER BY seq")
    return [json.loads(r["data"]) for r in rows]


def test_a_second_server_refuses_and_a_killed_one_never_blocks_a_restart(
    gateway: Callable[[str], Gateway], tmp_path: Path
) -> None:
    first_port = free_port_block()
    first = gateway(config(first_port, LONG_LEASE))
    assert first.proc is not None
    with first.client() as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    upstream = upstreams_alive(first_port, 10)
    assert len(upstream) == 1
    first.wait_for("SELECT 1 FROM events WHERE type = 'request_completed'")
    events_before = first.sql("SELECT seq, type FROM events ORDER BY seq")

    second_listen = f"127.0.0.1:{free_port()}"
    second = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--config", str(first.config)]
        + ["--listen", second_listen, "--db", str(first.db)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 1, second.stdout + second.stderr
    assert f"pid {first.proc.pid} on host {socket.gethostname()}" in second.stderr
    assert f"127.0.0.1:{first.port}" in second.stderr
    assert str(first.db) in second.stderr and "--db" in second.stderr
    assert "listening on http" not in second.stdout + second.stderr

    # It touched nothing: the first one's upstream runs, it still serves, no event was added.
    assert upstreams_alive(first_port, 10) == upstream
    assert first.sql("SELECT seq, type FROM events ORDER BY seq") == events_before
    with first.client() as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert upstreams_alive(first_port, 10) == upstream
    [lease] = leases(first)
    assert lease["term"] == 1 and lease["pid"] == first.proc.pid
    assert lease["listen"] == f"127.0.0.1:{first.port}"

    # SIGKILL leaves the lease live in the file: the next start takes it at once.
    first.kill()
    started = time.monotonic()
    restarted = gateway(config(first_port, LONG_LEASE))
    assert time.monotonic() - started < LONG_LEASE_S / 3  # before it could have expired
    assert restarted.proc is not None
    *_, taken = leases(restarted)
    assert taken["term"] == 2 and taken["pid"] == restarted.proc.pid
    assert taken["previous_pid"] == first.proc.pid and taken["previous_ended"] == "gone"
    with restarted.client() as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200

    # A clean stop releases it; the term stays.
    restarted.stop()
    [row] = restarted.sql("SELECT term, pid, renewed_at, expires_at FROM server_lease")
    assert (row["term"], row["pid"]) == (2, restarted.proc.pid)
    assert row["expires_at"] <= row["renewed_at"]
    assert upstreams_left(first_port, 10) == {}
    assert restarted.db_check().returncode == 0
    verified = subprocess.run(
        [sys.executable, "-m", "app.cli", "replay", str(restarted.db), "--verify"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_a_server_whose_lease_was_taken_over_stops_without_writing(
    gateway: Callable[[str], Gateway],
) -> None:
    first_port = free_port_block()
    gw = gateway(config(first_port))
    assert gw.proc is not None
    with gw.client() as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert upstreams_alive(first_port, 10)
    gw.wait_for("SELECT 1 FROM events WHERE type = 'request_completed'")
    # Another server took over (as a standby does once the lease lapses): a new term.
    with sqlite3.connect(gw.db, timeout=10, isolation_level=None) as conn:
        conn.execute("UPDATE server_lease SET term = term + 1, pid = 1, listen = 'elsewhere:1'")
    conn.close()
    events_then = gw.sql("SELECT count(*) AS n FROM events")[0]["n"]
    poll(
        lambda: gw.proc is not None and gw.proc.poll() is not None,
        "the fenced exit",
        timeout=RENEW_EVERY_S + 30,  # a hang guard
    )
    assert gw.proc.returncode == FENCED_EXIT
    assert "another gpulane took over" in gw.log.read_text()
    assert "elsewhere:1" in gw.log.read_text()
    assert gw.sql("SELECT count(*) AS n FROM events")[0]["n"] == events_then
    assert upstreams_left(first_port, 10) == {}
