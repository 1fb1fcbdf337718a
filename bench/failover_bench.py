"""Failover: from the leader's death to the standby's first dispatch. Prints figures.

    python -m bench.failover_bench [--rounds 20] [--how kill|freeze] [--lease SECONDS]
                                   [--apart] [--db URL]

Two `gpulane serve --standby` on one database, started as a user starts them,
in front of a fake upstream (tools.fake_upstream): by default a SQLite file and
then a throwaway PostgreSQL cluster (tests/postgres.py), side by side in one
run; `--db URL` measures that database alone (an empty one: the bench fills
it). `--apart` gives each front a host name of its own (GPULANE_HOST), as fronts
on two machines have: a killed leader is then found only by its lease lapsing,
as a frozen one is. Each round the leader
runs a durable job (it hangs) with another waiting behind it; then the bench
notes the time and kills the leader (`kill`: SIGKILL; `freeze`: SIGSTOP, as a
hung leader or a lost host looks to a standby: only the lease's expiry tells)
and waits for the standby's first `request_dispatched` after its takeover
(the event's own time, the same clock). The failover time is that dispatch's
time minus the kill's. The dead leader is then started again as the next
standby (a frozen one is killed first), and the roles swap.

What it measures, with `kill`: the standby's poll (every leaseSeconds / 30)
finds the leader's process gone from this host, takes the lease, recovers
(stops the dead leader's upstream, restores the jobs) and dispatches: the
model's load comes after the dispatch and is not counted. With `freeze`: the
lease must lapse first, so leaseSeconds dominates.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.e2e.gateway import Gateway, fake_model, free_port_block
from tests.postgres import Cluster


def config(first_port: int, lease: float) -> str:
    model = fake_model("m").replace("\n", "\n  ")
    return f"startPort: {first_port}\ndatabase: {{leaseSeconds: {lease:g}}}\nmodels:{model}\n"


def front(tmp: Path, name: str, text: str, db: str, apart: bool) -> Gateway:
    home = tmp / name
    home.mkdir()
    gw = Gateway(home, text)
    gw.db = db  # type: ignore[assignment]
    gw.args = ["--standby"]
    if apart:
        gw.env = {"GPULANE_HOST": f"front-{name}"}
    return gw


def leads(gw: Gateway) -> bool:
    try:
        with httpx.Client(timeout=2) as client:
            return client.get(gw.url + "/health").text == "OK"
    except httpx.HTTPError:
        return False


def job(gw: Gateway, **fake: object) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "fake": fake}
    with httpx.Client(timeout=10) as client:
        answer = client.post(
            gw.url + "/v1/chat/completions", json=body, headers={"Prefer": "respond-async"}
        )
    answer.raise_for_status()
    return str(answer.json()["id"])


def cancel(gw: Gateway, job_id: str) -> None:
    with httpx.Client(timeout=10) as client:
        client.delete(f"{gw.url}/v1/jobs/{job_id}")


STEPS = ("lease_acquired", "recovery_finished", "request_dispatched")
"""The standby's steps, each timed from the one before (from the kill, the first)."""


def steps_after(gw: Gateway, seq: int, timeout: float) -> list[float]:
    """Unix seconds of the first of each of STEPS after event `seq`."""
    query = "SELECT min(at) AS at FROM events WHERE type = ? AND seq > ?"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [gw.sql(query, step, seq)[0]["at"] for step in STEPS]
        if None not in found:
            return [float(at) for at in found]
        time.sleep(0.01)
    raise TimeoutError(f"no dispatch within {timeout} s:\n{gw.log.read_text()[-3000:]}")


def run(db: str, rounds: int, how: str, lease: float, apart: bool) -> list[list[float]]:
    """Per round: seconds from the kill to each of STEPS."""
    times: list[list[float]] = []
    with tempfile.TemporaryDirectory(prefix="gpulane-failover-") as tmp:
        text = config(free_port_block(), lease)
        db = db or str(Path(tmp) / "gpulane.db")
        leader = front(Path(tmp), "a", text, db, apart)
        standby = front(Path(tmp), "b", text, db, apart)
        try:
            leader.start()
            standby.start()
            for _ in range(rounds):
                running = job(leader, hang=True)
                job(leader)  # waits behind it
                leader.wait_for(
                    "SELECT 1 FROM events WHERE type = 'request_started' AND request_id = ?",
                    running,
                )
                seq = leader.sql("SELECT max(seq) AS s FROM events")[0]["s"]
                assert leader.proc is not None
                killed = time.time()
                if how == "kill":
                    leader.kill()
                else:
                    os.kill(leader.proc.pid, signal.SIGSTOP)
                times.append([at - killed for at in steps_after(standby, seq, lease * 3 + 30)])
                if how == "freeze":
                    leader.kill()  # SIGKILL ends a stopped process too
                while not leads(standby):
                    time.sleep(0.01)
                cancel(standby, running)  # the hanging job, so the next round starts clean
                leader.start()  # the next standby
                leader, standby = standby, leader
        finally:
            leader.stop()
            standby.stop()
    return times


@contextlib.contextmanager
def databases(url: str | None) -> Iterator[dict[str, str]]:
    """Name -> database (`""`: a new SQLite file in the round's directory)."""
    if url:
        yield {"given": url}
        return
    with Cluster.started(fsync=True) as cluster:
        yield {"sqlite": "", "postgres": cluster.new_database()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--how", choices=("kill", "freeze"), default="kill")
    parser.add_argument("--lease", type=float, default=15.0, help="database.leaseSeconds")
    parser.add_argument("--apart", action="store_true", help="a host name per front")
    parser.add_argument("--db", help="one database's URL (default: SQLite and PostgreSQL)")
    args = parser.parse_args()
    with databases(args.db) as dbs:
        times = {
            name: run(db, args.rounds, args.how, args.lease, args.apart) for name, db in dbs.items()
        }
    apart = ", fronts on two host names" if args.apart else ""
    what = f"{args.how}{apart}, leaseSeconds {args.lease:g}, {args.rounds} rounds"
    print(f"failover ({what}), from the kill, ms:")
    names = list(times)
    header = "".join(f"{name + ' median':>17} {name + ' max':>14}" for name in names)
    ratio = "   pg/sqlite (medians)" if names == ["sqlite", "postgres"] else ""
    print(f"  {'to':<20}{header}{ratio}")
    for i, step in enumerate(STEPS):
        medians = [statistics.median(t[i] for t in times[name]) * 1000 for name in names]
        line = "".join(
            f"{median:17.0f} {max(t[i] for t in times[name]) * 1000:14.0f}"
            for name, median in zip(names, medians, strict=True)
        )
        if ratio:
            line += f"   {medians[1] / medians[0]:.2f}"
        print(f"  {step:<20}{line}")


if __name__ == "__main__":
    main()
