"""`explain` and `replay --verify` on long synthetic logs made by the core itself: a
simulated run loop with random arrivals, cancels, swaps and crash-restarts whose
recovery restores durable jobs, recorded as this version records it (format 2:
`request_restored`) and as earlier versions did (format 1: nothing recorded, the
fold restores them); and on a real log of the earlier format.

Checks that starting the replay at the oldest request open on arrival gives the same
story as replaying the whole log, that every recorded decision is recomputed, and
that verify and explain agree.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest

from app.core import events as ev
from app.core.load_backoff import LoadBackoff
from app.core.policy import decide
from app.core.priority import band_of
from app.core.scoring import NS_PER_S, ScoringParams
from app.core.state import FIFO, SchedulerState, apply
from app.report import explain as explain_module
from app.report.explain import explain
from app.report.render import explanation_text
from app.store.engine import open_database
from tests.e2e.log_replay import assert_log_replays
from tests.unit.core_driver import CoreDriver
from tools.replay.generate import film, write_log
from tools.replay.simulate import Policy, simulate
from tools.replay.verify import verify

T0 = 1_700_000_000 * NS_PER_S
FORMAT1 = Path(__file__).parents[1] / "fixtures" / "restart_log_format1.jsonl"
TICK = NS_PER_S // 10
MODELS = ("A", "B", "C")


class Sim:
    """The run loop in miniature: every change is an event, applied then logged."""

    def __init__(self, rng: random.Random, log_format: int) -> None:
        self.rng = rng
        self.log_format = log_format
        self.log: list[ev.AnyEvent] = []
        self.now = T0
        self.first_enqueue: dict[str, ev.RequestEnqueued] = {}
        self.start_server(ScoringParams(2 * NS_PER_S, 10))

    def emit(self, *events: ev.AnyEvent) -> None:
        for event in events:
            apply(self.state, event)
            self.log.append(event)

    def start_server(self, params: ScoringParams) -> None:
        """A new process (a fresh state, as the live server builds it) and its recovery."""
        old = getattr(self, "state", None)
        self.state = SchedulerState(params, config_hash="h")
        self.running: tuple[str, int] | None = None  # request, run end
        self.swap_end: int | None = None
        self.emit(
            ev.ServerStarted(
                at=self.now,
                version="t",
                config_hash="h",
                scheduler="serial",
                aging_divisor_ns=params.aging_divisor_ns,
                swap_affinity_bonus=params.swap_affinity_bonus,
                log_format=self.log_format,
            )
        )
        if old is None:
            return
        # Recovery as app/runtime/recovery.py does it (format 1: as it did before
        # restores were recorded, putting the jobs back without an event).
        after: list[ev.AnyEvent] = []
        requeues: list[ev.AnyEvent] = []
        for request_id in [r for r in self.first_enqueue if r in old.requests]:
            request = old.requests[request_id]
            if not request.durable:
                after.append(ev.RequestAbandoned(at=self.now, request_id=request_id))
                continue
            if self.log_format >= 2:
                after.append(
                    ev.RequestRestored(
                        at=self.now,
                        request_id=request_id,
                        model=request.model,
                        priority=request.priority,
                        enqueued_at=request.enqueued_ns,
                        attempt=request.attempt,
                    )
                )
            else:
                first = self.first_enqueue[request_id]
                apply(
                    self.state,
                    msgspec.structs.replace(
                        first, attempt=request.attempt, enqueued_at=request.enqueued_ns
                    ),
                )
            if request.running:
                requeue = ev.RequestRequeued(
                    at=self.now, request_id=request_id, attempt=request.attempt + 1
                )
                # Format 2: right after its restore (it keeps its place); format 1
                # re-queued the running jobs after all the rest.
                (after if self.log_format >= 2 else requeues).append(requeue)
        self.emit(*after, *requeues, ev.RecoveryFinished(at=self.now))

    def arrive(self, n: int) -> None:
        priority = self.rng.choice((-100, -100, 0, 0, 0, 1, 2, 100))
        event = ev.RequestEnqueued(
            at=self.now,
            request_id=f"r{n}",
            model=self.rng.choice(MODELS),
            model_requested="x",
            endpoint="/v1/chat/completions",
            priority=priority,
            band=band_of(priority),
            durable=self.rng.random() < 0.3,
        )
        self.first_enqueue[event.request_id] = event
        self.emit(event)

    def step(self) -> None:
        self.now += TICK
        if self.swap_end is not None and self.now >= self.swap_end:
            assert self.state.loading is not None and self.running is not None
            self.emit(ev.SwapFinished(at=self.now, model=self.state.loading, duration_ms=300.0))
            self.emit(ev.RequestStarted(at=self.now, request_id=self.running[0]))
            self.swap_end = None
        elif self.running is not None and self.swap_end is None and self.now >= self.running[1]:
            self.emit(ev.RequestCompleted(at=self.now, request_id=self.running[0], http_status=200))
            self.running = None
        waiting = [q.request_id for q in self.state.queue]
        if waiting and self.rng.random() < 0.03:
            self.emit(
                ev.RequestCancelled(
                    at=self.now, request_id=self.rng.choice(waiting), reason="client_gone"
                )
            )
        while decision := decide(self.state, self.now):
            self.emit(*decision.events)
            dispatched = decision.dispatched
            run_end = self.now + self.rng.randint(1, 8) * TICK
            self.running = (dispatched.request_id, run_end)
            if dispatched.swap:
                self.emit(
                    ev.SwapStarted(
                        at=self.now,
                        from_model=self.state.resident,
                        to_model=dispatched.model,
                        request_id=dispatched.request_id,
                    )
                )
                self.swap_end = self.now + 3 * TICK
                self.running = (dispatched.request_id, run_end + 3 * TICK)
            else:
                self.emit(ev.RequestStarted(at=self.now, request_id=dispatched.request_id))


def simulated_log(seed: int, log_format: int, requests: int = 150) -> list[ev.AnyEvent]:
    rng = random.Random(seed)
    sim = Sim(rng, log_format)
    n = 0
    crashes = [requests // 4, requests // 2, 3 * requests // 4]
    while n < requests or sim.state.requests:
        if n < requests and rng.random() < 0.12:
            sim.arrive(n)
            n += 1
        open_jobs = [r for r in sim.state.requests.values() if r.durable]
        if crashes and n >= crashes[0] and open_jobs:  # a crash, new parameters
            crashes.pop(0)
            sim.start_server(ScoringParams(NS_PER_S * (1 + len(crashes)), 5 * len(crashes)))
        sim.step()
    return sim.log


@pytest.fixture(scope="module", params=[(1, 2), (2, 2), (1, 1)], ids=str)
def database(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("explain") / "gpulane.db"
    seed, log_format = request.param
    write_log(path, simulated_log(seed, log_format))
    return path


def test_replay_from_the_start_point_equals_replay_from_the_beginning(
    database: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = open_database(database, upgrade=False)
    with engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT id, status FROM requests").all()
        recorded = {
            seq: ev.decode(data)
            for seq, data in conn.exec_driver_sql(
                "SELECT seq, data FROM events WHERE type = 'scores_computed'"
            )
        }
    assert len(rows) > 100 and {"completed", "cancelled"} <= {s for _, s in rows}
    starts: list[int] = []
    real_start = explain_module.replay_start

    def recording_start(*args: Any) -> int:
        starts.append(real_start(*args))
        return starts[-1]

    monkeypatch.setattr(explain_module, "replay_start", recording_start)
    quick = {request_id: explain(engine, request_id) for request_id, _ in rows}
    assert max(starts) > len(recorded)  # late requests replay a short tail of the log
    monkeypatch.setattr(explain_module, "replay_start", lambda *args: 1)
    slow = {request_id: explain(engine, request_id) for request_id, _ in rows}
    engine.dispose()
    assert quick == slow
    covered = set()
    for story in quick.values():
        assert story is not None and story.replay_matches, story
        assert math.isclose(sum(p.seconds for p in story.wait), story.wait_s, abs_tol=1e-6)
        for d in story.decisions:
            scores = recorded[d.seq]
            assert isinstance(scores, ev.ScoresComputed)
            assert d.matches_record and d.winner == scores.winner
            if d.winner_id == story.request_id:
                covered.add(d.seq)
    assert covered == set(recorded)


def test_a_durable_job_across_a_restart(database: Path) -> None:
    engine = open_database(database, upgrade=False)
    with engine.connect() as conn:
        ids = [
            r[0]
            for r in conn.exec_driver_sql(
                "SELECT request_id FROM events WHERE type = 'request_requeued'"
            )
        ]
        resumed = conn.exec_driver_sql(
            "SELECT id FROM requests WHERE durable AND status = 'completed' AND enqueue_seq < "
            "(SELECT max(seq) FROM events WHERE type = 'server_started') AND dispatched_at > "
            "(SELECT max(at) FROM events WHERE type = 'server_started')"
        ).all()
    stories = [explain(engine, i) for i in ids + [r[0] for r in resumed]]
    engine.dispose()
    if not stories:
        pytest.skip("this seed restarted with no durable job open")
    for story in stories:
        assert story is not None and story.replay_matches
        assert story.status == "completed"


def test_verify_and_explain_agree_on_a_log_with_several_restarts(database: Path) -> None:
    engine = open_database(database, upgrade=False)
    with engine.connect() as conn:
        starts = conn.exec_driver_sql(
            "SELECT count(*) FROM events WHERE type = 'server_started'"
        ).scalar()
        formats = {
            f
            for (f,) in conn.exec_driver_sql(
                "SELECT coalesce(json_extract(data, '$.log_format'), 1) FROM events "
                "WHERE type = 'server_started'"
            )
        }
        restores = conn.exec_driver_sql(
            "SELECT count(*) FROM events WHERE type = 'request_restored'"
        ).scalar_one()
    engine.dispose()
    assert starts == 4 and len(formats) == 1
    assert (restores > 0) == (formats == {2})
    assert assert_log_replays(database) > 100


def test_a_real_log_of_the_earlier_format_with_a_restart_still_verifies(tmp_path: Path) -> None:
    """tests/fixtures/restart_log_format1.jsonl (never regenerated) is the log of
    tests/e2e/test_jobs.py's SIGKILL scenario as gpulane wrote it before recovery
    recorded `request_restored`: a durable job running and five queued, a synchronous
    request waiting; SIGKILL; restart; all six run."""
    events = [ev.decode(line) for line in FORMAT1.read_text().splitlines()]
    starts = [i for i, e in enumerate(events) if isinstance(e, ev.ServerStarted)]
    assert len(starts) == 2 and all(events[i].log_format == 1 for i in starts)  # type: ignore[union-attr]
    assert not any(isinstance(e, ev.RequestRestored) for e in events)
    db = tmp_path / "format1.db"
    write_log(db, events)
    assert assert_log_replays(db) == 7
    # The documented rule makes it verify: read as format 2 (no restores recorded,
    # so none happened), the restarted process would have nothing to dispatch.
    as_format2 = [
        msgspec.structs.replace(e, log_format=2) if isinstance(e, ev.ServerStarted) else e
        for e in events
    ]
    divergence = verify(enumerate(as_format2, 1)).divergence
    assert divergence is not None and "dispatches nothing" in divergence.detail
    # Folded to the end of that recovery: the five that waited, then the one that ran.
    recovered = next(
        i for i, e in enumerate(events) if isinstance(e, ev.RecoveryFinished) and i > starts[1]
    )
    state = SchedulerState()
    for event in events[: recovered + 1]:
        apply(state, event)
    running = next(e for e in events if isinstance(e, ev.RequestDispatched)).request_id
    waited = [e.request_id for e in events[: starts[1]] if isinstance(e, ev.RequestEnqueued)]
    assert list(state.requests) == [r for r in waited if state.requests.get(r)]
    assert [q.request_id for q in sorted(state.queue, key=lambda q: q.order)][-1] == running
    assert len(state.queue) == 6 and state.requests[running].attempt == 2
    assert state.running == {} and state.resident is None


def test_a_fifo_log_replays_with_the_priorities_and_limits_it_records(tmp_path: Path) -> None:
    scenario = film(3, limit=300)
    policy = Policy(
        "fifo",
        ScoringParams(0, 0),
        scheduler=FIFO,
        concurrency=2,
        model_priority=(("qwen-chat", -5), ("wan-video", 60)),
    )
    events: list[ev.AnyEvent] = []
    simulate(scenario.workload, policy, record=events, swap_cost=scenario.swap_cost)
    started = events[0]
    assert isinstance(started, ev.ServerStarted)
    assert started.model_priority == {"qwen-chat": -5, "wan-video": 60}
    assert set(started.concurrency.values()) == {2}
    db = tmp_path / "fifo.db"
    write_log(db, events)
    # Nothing is inferred or taken from a config: the CLI's explain and verify read
    # the settings from the log, and they decide.
    assert assert_log_replays(db) > 200
    without = [msgspec.structs.replace(started, model_priority={}), *events[1:]]
    assert verify(enumerate(without, 1)).divergence is not None


# -- the replay report on a generated two-callers log ------------------------------------


def test_the_fair_scenario_replayed_with_fair_share_serves_the_second_caller_early(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tools.replay.cli import replay_command

    db = tmp_path / "fair.db"
    assert replay_command(["generate", "fair", "--out", str(db), "--seed", "1"]) == 0
    capsys.readouterr()
    args = [str(db), "--sweep", "fair=0,20", "--shake", "2", "--jobs", "2", "--no-reference"]
    assert replay_command([*args, "--json"]) == 0
    out = msgspec.json.decode(capsys.readouterr().out)
    runs = {r["label"]: r for r in out["runs"]}
    assert list(runs) == ["recorded", "aging=60s bonus=10 (recorded)", "aging=60s bonus=10 fair=20"]
    off = runs["aging=60s bonus=10 (recorded)"]["callers"]["member-b"]
    on = runs["aging=60s bonus=10 fair=20"]["callers"]["member-b"]
    assert on["first_start_s"] < 600 < 12 * 3600 < off["first_start_s"]
    assert on["last_finish_s"] < off["last_finish_s"]
    # Generated with the recorded parameters, the log is what the simulation does.
    assert out["simulation_error"]["batch"] == {
        "wait_p95_s": 0.0,
        "wait_max_s": 0.0,
        "left": 0.0,
        "fairness": 0.0,
    }
    # Durable jobs are no observation of a client's patience.
    assert out["patience"] == []
    assert replay_command([*args, "--by", "caller"]) == 0
    text = capsys.readouterr().out
    assert "member-b" in text and "first start" in text and "simulation error" in text


def test_replay_options_for_the_new_terms_are_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tools.replay.cli import replay_command

    db = tmp_path / "fair.db"
    assert replay_command(["generate", "fair", "--out", str(db), "--fair-share-bonus", "20"]) == 0
    capsys.readouterr()
    assert replay_command([str(db), "--json", "--no-reference", "--short-job-bonus", "5"]) == 0
    out = msgspec.json.decode(capsys.readouterr().out)
    assert out["recorded"]["fair_share_bonus"] == 20
    assert [r["label"] for r in out["runs"]][1:] == [
        "aging=60s bonus=10 fair=20 (recorded)",
        "aging=60s bonus=10 fair=20 short=5",
    ]
    for bad in (
        ["--patience", "vip=1m"],
        ["--sweep", "fair=0,20", "--fair-share-bonus", "10"],
        ["--fair-share-bonus", "50", "--short-job-bonus", "50"],
        ["--by", "colour"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            replay_command([str(db), *bad])
        assert exit_info.value.code == 2
        assert "error:" in capsys.readouterr().err


def test_explain_charges_the_wait_of_a_model_backing_off_to_load_backoff(tmp_path: Path) -> None:
    """A2 waits out A's back-off (5 s after one failed load) while B1 runs."""
    d = CoreDriver(
        ScoringParams(60 * NS_PER_S, 10),
        load_backoff=LoadBackoff(5 * NS_PER_S, 60 * NS_PER_S, 3),
    )
    d.enqueue("A1", "A", 100)
    d.enqueue("A2", "A", 100)
    d.enqueue("B1", "B")
    assert d.dispatch_all() == ["A1"]
    d.start_swap("A", "A1")
    d.advance(NS_PER_S)
    d.fail_swap("A")
    assert d.serve_all() == ["B1"]  # at once, B1 runs 0 s
    d.advance(5 * NS_PER_S)
    assert d.serve_all() == ["A2"]
    db = tmp_path / "backoff.db"
    write_log(db, d.log)
    engine = open_database(db, upgrade=False)
    try:
        story = explain(engine, "A2")
    finally:
        engine.dispose()
    assert story is not None and story.replay_matches
    parts = {p.cause: p.seconds for p in story.wait}
    assert parts["load_backoff"] == 5.0 and story.failed_loads == 1
    assert "while model A backed off after 1 failed load " in explanation_text(story)
    assert verify(enumerate(d.log, start=1)).ok
