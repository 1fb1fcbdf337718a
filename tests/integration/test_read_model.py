"""The read models as the event store writes them, and `gpulane db rebuild | check` over them."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from app.core import events as ev
from app.core.scoring import Breakdown
from app.store import commands
from app.store.engine import open_database
from app.store.event_store import SqliteEventStore, last_seq, open_processes, open_requests
from app.store.tables import READ_MODELS

T0 = 1_735_689_600_000_000_000
S = 1_000_000_000  # one second in ns
Groups = list[list[ev.AnyEvent]]


def enqueued(rid: str, at: int, model: str = "qwen", priority: int = 0, **kw: Any) -> ev.AnyEvent:
    band = "interactive" if priority >= 50 else "batch" if priority <= -50 else "normal"
    return ev.RequestEnqueued(
        at=at,
        request_id=rid,
        model=model,
        model_requested=kw.pop("model_requested", model),
        endpoint="/v1/chat/completions",
        priority=priority,
        band=band,
        **kw,
    )


def scores(rid: str, at: int, total: float) -> ev.AnyEvent:
    winner = Breakdown(priority=int(total), affinity=0, aging=total - int(total), total=total)
    return ev.ScoresComputed(at=at, request_id=rid, queue_depth=1, resident=None, winner=winner)


def story() -> Groups:
    """A day in the life: every kind of outcome, swaps, a crash and its recovery."""
    job = {"method": "POST", "path": "/v1/completions", "headers": {}, "body": "{}"}
    g: Groups = [
        [ev.ServerStarted(at=T0, version="0", config_hash="h", scheduler="serial",
                          aging_divisor_ns=60 * S, swap_affinity_bonus=10)],
        # Preload: a swap no request caused.
        [ev.SwapStarted(at=T0 + 1, from_model=None, to_model="qwen"),
         ev.ProcessStarted(at=T0 + 2, model="qwen", pid=100, cmdline=["llama-server", "-m", "q"],
                           port=9001),
         ev.SwapFinished(at=T0 + 2 * S, model="qwen", duration_ms=2000.0)],
        [enqueued("r1", T0 + 10 * S, priority=100, caller="alice")],
        [enqueued("r2", T0 + 11 * S, model="llama", model_requested="llama-alias")],
        [enqueued("r3", T0 + 12 * S)],
        [enqueued("job", T0 + 13 * S, priority=-100, durable=True, idempotency_key="k1", job=job)],
        [enqueued("r4", T0 + 14 * S)],
        # r1 runs on the resident model.
        [scores("r1", T0 + 15 * S, 100.5),
         ev.RequestDispatched(at=T0 + 15 * S, request_id="r1", model="qwen"),
         ev.RequestStarted(at=T0 + 15 * S + S // 100, request_id="r1")],
        [ev.RequestCompleted(at=T0 + 17 * S, request_id="r1", http_status=200, bytes=4096,
                             ttfb_ms=40.0, run_ms=1990.0, input_tokens=10, output_tokens=200,
                             tokens_per_second=100.5)],
        # r3's client goes away while it waits.
        [ev.RequestCancelled(at=T0 + 17 * S + 1, request_id="r3", reason="client_gone")],
        # r2 needs llama: a swap it caused, and then it fails.
        [scores("r2", T0 + 18 * S, 0.25),
         ev.RequestDispatched(at=T0 + 18 * S, request_id="r2", model="llama", swap=True),
         ev.SwapStarted(at=T0 + 18 * S, from_model="qwen", to_model="llama", request_id="r2"),
         ev.ProcessStopped(at=T0 + 18 * S + 1, model="qwen", pid=100, reason="evicted",
                           exit_code=0),
         ev.ProcessStarted(at=T0 + 18 * S + 2, model="llama", pid=101, cmdline=["llama-server"])],
        [ev.SwapFinished(at=T0 + 21 * S, model="llama", duration_ms=3000.0),
         ev.RequestStarted(at=T0 + 21 * S, request_id="r2")],
        [ev.RequestFailed(at=T0 + 22 * S, request_id="r2", error="upstream reset",
                          http_status=502)],
        # The durable job starts; r4 is still waiting when the server dies.
        [scores("job", T0 + 23 * S, -99.0),
         ev.RequestDispatched(at=T0 + 23 * S, request_id="job", model="qwen", swap=True),
         ev.SwapStarted(at=T0 + 23 * S, from_model="llama", to_model="qwen", request_id="job")],
        # -- crash; a new process recovers.
        [ev.ServerStarted(at=T0 + 60 * S, version="0", config_hash="h", scheduler="serial",
                          aging_divisor_ns=60 * S, swap_affinity_bonus=10)],
        [ev.ProcessStopped(at=T0 + 60 * S + 1, model="llama", pid=101, reason="recovered"),
         ev.RequestRequeued(at=T0 + 60 * S + 2, request_id="job", attempt=2),
         ev.RequestAbandoned(at=T0 + 60 * S + 3, request_id="r4"),
         ev.RecoveryFinished(at=T0 + 60 * S + 4, requeued=1, abandoned=1, processes_stopped=1)],
        # Attempt 2: its swap fails, the job fails; a retry enqueues attempt 3, which completes.
        [ev.RequestDispatched(at=T0 + 61 * S, request_id="job", model="qwen", attempt=2, swap=True),
         ev.SwapStarted(at=T0 + 61 * S, from_model=None, to_model="qwen", request_id="job"),
         ev.SwapFailed(at=T0 + 62 * S, model="qwen", error="exit 1", duration_ms=1000.0),
         ev.RequestFailed(at=T0 + 62 * S, request_id="job", error="swap failed")],
        [enqueued("job", T0 + 63 * S, priority=-100, durable=True, idempotency_key="k1", job=job,
                  attempt=3, enqueued_at=T0 + 13 * S)],
        [ev.RequestDispatched(at=T0 + 64 * S, request_id="job", model="qwen", attempt=3, swap=True),
         ev.SwapStarted(at=T0 + 64 * S, from_model=None, to_model="qwen", request_id="job"),
         ev.ProcessStarted(at=T0 + 64 * S, model="qwen", pid=102, cmdline=["llama-server", "q"]),
         ev.SwapFinished(at=T0 + 65 * S, model="qwen", duration_ms=1000.0),
         ev.RequestStarted(at=T0 + 65 * S, request_id="job")],
        [ev.RequestCompleted(at=T0 + 66 * S, request_id="job", http_status=200)],
        [ev.RequestRejected(at=T0 + 67 * S, request_id="bad", endpoint="/v1/chat/completions",
                            http_status=404, error="unknown model", model_requested="gpt-9")],
        # Still open at the end: r5 running, r6 and r7 queued (r7 arrived first).
        [enqueued("r7", T0 + 68 * S), enqueued("r6", T0 + 69 * S), enqueued("r5", T0 + 70 * S)],
        [ev.RequestDispatched(at=T0 + 71 * S, request_id="r5", model="qwen")],
    ]  # fmt: skip
    return g


def simulated(seed: int, n: int = 150) -> Groups:
    """A random but valid log: many requests over three models, served one at a time."""
    rng = random.Random(seed)
    groups: Groups = []
    now = T0
    waiting: list[str] = []
    model_of: dict[str, str] = {}
    resident: str | None = None
    pid = 1000
    for i in range(n):
        now += rng.randint(1, 3 * S)
        rid = f"s{seed}-{i}"
        model_of[rid] = rng.choice("abc")
        groups.append([enqueued(rid, now, model_of[rid], priority=rng.choice([-100, 0, 100]))])
        waiting.append(rid)
        if rng.random() < 0.6 and waiting:
            rid = waiting.pop(rng.randrange(len(waiting)))
            model = model_of[rid]
            group: list[ev.AnyEvent] = [
                scores(rid, now, rng.random() * 100),
                ev.RequestDispatched(at=now, request_id=rid, model=model, swap=model != resident),
            ]
            if model != resident:
                pid += 1
                group += [
                    ev.SwapStarted(at=now, from_model=resident, to_model=model, request_id=rid),
                    ev.ProcessStarted(at=now, model=model, pid=pid, cmdline=[model]),
                    ev.SwapFinished(at=now + S, model=model, duration_ms=1000.0),
                ]
                resident = model
            group.append(ev.RequestStarted(at=now + S, request_id=rid))
            outcome = rng.random()
            if outcome < 0.8:
                group.append(ev.RequestCompleted(at=now + 2 * S, request_id=rid, http_status=200))
            elif outcome < 0.9:
                group.append(ev.RequestFailed(at=now + 2 * S, request_id=rid, error="boom"))
            else:
                group.append(ev.RequestCancelled(at=now + 2 * S, request_id=rid, reason="explicit"))
            groups.append(group)
        elif rng.random() < 0.05 and waiting:
            rid = waiting.pop()
            groups.append([ev.RequestCancelled(at=now, request_id=rid, reason="client_gone")])
    return groups


async def write(path: Path, groups: Groups) -> Engine:
    """Submit groups as the run loop would, awaiting only the last."""
    engine = open_database(path)
    store = SqliteEventStore(engine)
    store.start()
    for group in groups:
        future = store.submit(group)
    await future
    await store.close()
    return engine


def snapshot(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
    with engine.connect() as conn:
        return {
            t.name: [tuple(r) for r in conn.exec_driver_sql(f"SELECT * FROM {t.name} ORDER BY 1")]
            for t in READ_MODELS
        }


def rows(engine: Engine, table: str) -> dict[Any, dict[str, Any]]:
    with engine.connect() as conn:
        result = conn.exec_driver_sql(f"SELECT * FROM {table}").mappings()
        return {row[next(iter(row.keys()))]: dict(row) for row in result}


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[tuple[Path, Engine]]:
    path = tmp_path / "gpulane.db"
    engine = await write(path, story())
    yield path, engine
    engine.dispose()


# -- what each event does to the requests table ---------------------------------------------


async def test_completed_request(db: tuple[Path, Engine]) -> None:
    r1 = rows(db[1], "requests")["r1"]
    expected = {
        "model": "qwen",
        "model_requested": "qwen",
        "priority": 100,
        "band": "interactive",
        "status": "completed",
        "durable": 0,
        "attempt": 1,
        "caller": "alice",
        "enqueued_at": pytest.approx(T0 / S + 10),
        "dispatched_at": pytest.approx(T0 / S + 15),
        "started_at": pytest.approx(T0 / S + 15.01),
        "finished_at": pytest.approx(T0 / S + 17),
        "score": 100.5,
        "queue_wait_ms": pytest.approx(5000.0),
        "swap_ms": None,
        "run_ms": 1990.0,
        "ttfb_ms": 40.0,
        "bytes": 4096,
        "http_status": 200,
        "input_tokens": 10,
        "output_tokens": 200,
        "tokens_per_second": 100.5,
        "error": None,
        "cancel_reason": None,
        "job": None,
    }
    assert {key: r1[key] for key in expected} == expected


async def test_failed_request_after_the_swap_it_caused(db: tuple[Path, Engine]) -> None:
    r2 = rows(db[1], "requests")["r2"]
    assert (r2["status"], r2["model_requested"], r2["swap_ms"]) == ("failed", "llama-alias", 3000.0)
    assert (r2["error"], r2["http_status"]) == ("upstream reset", 502)
    assert r2["run_ms"] == pytest.approx(1000.0)  # from started_at, the event had none


async def test_cancelled_abandoned_and_rejected(db: tuple[Path, Engine]) -> None:
    requests = rows(db[1], "requests")
    assert (requests["r3"]["status"], requests["r3"]["cancel_reason"]) == (
        "cancelled",
        "client_gone",
    )
    assert requests["r3"]["dispatched_at"] is None and requests["r3"]["run_ms"] is None
    assert (requests["r4"]["status"], requests["r4"]["finished_at"]) == (
        "abandoned",
        pytest.approx(T0 / S + 60),
    )
    bad = requests["bad"]
    assert (bad["status"], bad["model"], bad["model_requested"]) == ("failed", None, "gpt-9")
    assert bad["dispatched_at"] is None and bad["finished_at"] == bad["enqueued_at"]
    assert (bad["http_status"], bad["error"]) == (404, "unknown model")


async def test_a_durable_job_through_requeue_retry_and_completion(db: tuple[Path, Engine]) -> None:
    job = rows(db[1], "requests")["job"]
    assert (job["status"], job["attempt"], job["durable"], job["idempotency_key"]) == (
        "completed",
        3,
        1,
        "k1",
    )
    assert json.loads(job["job"])["path"] == "/v1/completions"
    # A new attempt keeps the original arrival: aging continues.
    assert job["enqueued_at"] == pytest.approx(T0 / S + 13)
    assert job["queue_wait_ms"] == pytest.approx(51_000.0)
    assert (job["swap_ms"], job["error"]) == (1000.0, None)


async def test_swaps_and_processes(db: tuple[Path, Engine]) -> None:
    swaps = sorted(rows(db[1], "swaps").values(), key=lambda s: s["seq"])
    assert [(s["to_model"], s["request_id"], s["duration_ms"], s["error"]) for s in swaps] == [
        ("qwen", None, 2000.0, None),
        ("llama", "r2", 3000.0, None),
        ("qwen", "job", None, "interrupted by restart"),
        ("qwen", "job", 1000.0, "exit 1"),
        ("qwen", "job", 1000.0, None),
    ]
    processes = sorted(rows(db[1], "processes").values(), key=lambda p: p["seq"])
    assert [(p["pid"], p["stop_reason"]) for p in processes] == [
        (100, "evicted"),
        (101, "recovered"),
        (102, None),
    ]
    assert [(p.pid, p.cmdline, p.port) for p in open_processes(db[1])] == [
        (102, ["llama-server", "q"], None)
    ]


async def test_open_requests_in_arrival_order(db: tuple[Path, Engine]) -> None:
    assert [(r.id, r.status) for r in open_requests(db[1])] == [
        ("r7", "queued"),
        ("r6", "queued"),
        ("r5", "running"),
    ]


# -- rebuild ---------------------------------------------------------------------------------


async def test_rebuild_gives_the_tables_the_live_writer_built(
    db: tuple[Path, Engine], capsys: pytest.CaptureFixture[str]
) -> None:
    path, engine = db
    live = snapshot(engine)
    with engine.begin() as conn:  # damage the read models; the log is the truth
        conn.exec_driver_sql("DELETE FROM requests WHERE id = 'r1'")
        conn.exec_driver_sql("UPDATE processes SET stopped_at = NULL")
        conn.exec_driver_sql("DELETE FROM projection_position")
    assert commands.rebuild(str(path)) == 0
    assert snapshot(engine) == live
    assert live["projection_position"] == [("read_models", last_seq(engine))]
    assert "ok: rebuilt from" in capsys.readouterr().out


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_rebuild_matches_live_on_simulated_logs(tmp_path: Path, seed: int) -> None:
    path = tmp_path / "gpulane.db"
    engine = await write(path, simulated(seed))
    live = snapshot(engine)
    assert commands.rebuild(str(path)) == 0
    assert snapshot(engine) == live
    assert commands.check(str(path)) == 0
    engine.dispose()


def test_rebuild_of_a_missing_file_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert commands.rebuild(str(tmp_path / "nope.db")) == 1
    err = capsys.readouterr().err
    assert "nope.db: no such database file" in err
    assert "--db PATH" in err and str(tmp_path) in err  # where it looked, and what to do


# -- check -----------------------------------------------------------------------------------


async def test_check_passes_a_valid_log(
    db: tuple[Path, Engine], capsys: pytest.CaptureFixture[str]
) -> None:
    assert commands.check(str(db[0])) == 0
    events = sum(len(group) for group in story())
    assert capsys.readouterr().out.strip() == f"ok: {events} events, 9 requests"


async def test_check_prints_the_offending_seqs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gpulane.db"
    engine = await write(
        path,
        [
            [enqueued("a", T0)],
            [ev.RequestDispatched(at=T0 + 1, request_id="ghost", model="qwen")],
            [ev.RequestCompleted(at=T0 + 2, request_id="a", http_status=200)],
            [ev.RequestFailed(at=T0 + 3, request_id="a", error="twice")],
        ],
    )
    engine.dispose()
    assert commands.check(str(path)) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("seq 2: request_dispatched for ghost")
    assert out[1].startswith("seq 4: second terminal event (request_failed) for a")
    assert out[-1] == "failed: 2 violations in 4 events"


async def test_check_reports_an_undecodable_event(
    db: tuple[Path, Engine], capsys: pytest.CaptureFixture[str]
) -> None:
    path, engine = db
    with engine.begin() as conn:
        conn.exec_driver_sql('UPDATE events SET data = \'{"type": "nonsense"}\' WHERE seq = 3')
    assert commands.check(str(path)) == 1
    assert "seq 3: cannot decode" in capsys.readouterr().out


async def test_rebuild_refuses_an_undecodable_event_and_changes_nothing(
    db: tuple[Path, Engine], capsys: pytest.CaptureFixture[str]
) -> None:
    path, engine = db
    before = snapshot(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE events SET data = 'not json' WHERE seq = 5")
    assert commands.rebuild(str(path)) == 1
    assert "rebuild failed, nothing changed: seq 5: cannot decode" in capsys.readouterr().err
    assert snapshot(engine) == before


def test_check_refuses_a_file_that_is_not_a_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gpulane.db"
    path.write_bytes(b"\x00" * 4096)
    assert commands.check(str(path)) == 1
    assert str(path) in capsys.readouterr().err


def test_check_reports_a_damaged_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gpulane.db"
    engine = open_database(path)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE padding (x)")
        conn.exec_driver_sql("CREATE INDEX ix_padding ON padding (x)")
        conn.exec_driver_sql("INSERT INTO padding VALUES (?)", [(f"{i:0900}",) for i in range(50)])
        root = conn.exec_driver_sql(
            "SELECT rootpage FROM sqlite_master WHERE name = 'ix_padding'"
        ).scalar_one()
    engine.dispose()
    with path.open("r+b") as f:  # wreck one index page; the schema itself stays readable
        f.seek((root - 1) * 4096 + 8)
        f.write(b"\xff" * 2000)
    assert commands.check(str(path)) == 1
    err = capsys.readouterr().err
    assert f"{path}: the database file is corrupt" in err
    assert "gpulane db backup" in err


# -- the SQL in docs/events.md ---------------------------------------------------------------

DOC = Path(__file__).parents[2] / "docs" / "events.md"


def doc_queries() -> list[str]:
    blocks = DOC.read_text().split("```sql\n")[1:]
    return [block.split("```")[0] for block in blocks]


def test_the_docs_have_example_sql() -> None:
    assert len(doc_queries()) >= 8


@pytest.mark.parametrize("query", doc_queries(), ids=lambda q: q.split("\n")[0][:40])
async def test_the_sql_in_the_docs_runs(db: tuple[Path, Engine], query: str) -> None:
    with db[1].connect() as conn:
        cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        columns = cursor.execute(query, {"request_id": "r2"}).description
    assert columns
