"""`explain` on long synthetic logs made by the core itself: a simulated run loop with
random arrivals, cancels, swaps and a crash-restart that restores durable jobs.

Checks that starting the replay at the oldest request open on arrival gives the same
story as replaying the whole log, and that every recorded decision is recomputed.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest

from app.core import events as ev
from app.core.policy import decide
from app.core.priority import band_of
from app.core.scoring import NS_PER_S, ScoringParams
from app.core.state import SchedulerState, apply
from app.report import explain as explain_module
from app.report.explain import explain
from app.store.engine import open_database
from app.store.event_store import driver_cursor, next_seq, write_events

T0 = 1_700_000_000 * NS_PER_S
TICK = NS_PER_S // 10
MODELS = ("A", "B", "C")


class Sim:
    """The run loop in miniature: every change is an event, applied then logged."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.log: list[ev.AnyEvent] = []
        self.now = T0
        self.first_enqueue: dict[str, ev.RequestEnqueued] = {}
        self.start_server(ScoringParams(2 * NS_PER_S, 10))

    def emit(self, *events: ev.AnyEvent) -> None:
        for event in events:
            apply(self.state, event)
            self.log.append(event)

    def start_server(self, params: ScoringParams) -> None:
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
            )
        )
        if old is None:
            return
        # Recovery as app/runtime/recovery.py does it.
        after: list[ev.AnyEvent] = []
        for request_id in [r for r in self.first_enqueue if r in old.requests]:
            request = old.requests[request_id]
            if not request.durable:
                after.append(ev.RequestAbandoned(at=self.now, request_id=request_id))
                continue
            first = self.first_enqueue[request_id]
            apply(
                self.state,
                msgspec.structs.replace(
                    first, attempt=request.attempt, enqueued_at=request.enqueued_ns
                ),
            )
            if request.running:
                after.append(
                    ev.RequestRequeued(
                        at=self.now, request_id=request_id, attempt=request.attempt + 1
                    )
                )
        self.emit(*after, ev.RecoveryFinished(at=self.now))

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
            self.emit(*decision)
            dispatched = decision[1]
            assert isinstance(dispatched, ev.RequestDispatched)
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


def simulate(seed: int, requests: int = 150) -> list[ev.AnyEvent]:
    rng = random.Random(seed)
    sim = Sim(rng)
    n = 0
    crashed = False
    while n < requests or sim.state.requests:
        if n < requests and rng.random() < 0.12:
            sim.arrive(n)
            n += 1
        open_jobs = [r for r in sim.state.requests.values() if r.durable]
        if n >= requests // 2 and not crashed and open_jobs:  # a crash, new parameters
            sim.start_server(ScoringParams(NS_PER_S, 5))
            crashed = True
        sim.step()
    return sim.log


@pytest.fixture(scope="module", params=[1, 2])
def database(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("explain") / "gpulane.db"
    engine = open_database(path)
    log = simulate(request.param)
    with engine.connect() as conn, conn.begin():
        cur = driver_cursor(conn)
        write_events(cur, next_seq(cur), log)
    engine.dispose()
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
