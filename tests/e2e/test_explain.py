"""`gpulane explain`, GET /api/requests/{id}/explain, GET /api/queue and `gpulane queue`,
against the log of a real run (tests/e2e/realistic_run.py describes it)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import msgspec
import pytest
from sqlalchemy import Engine

from app import cli
from app.core import events as ev
from app.core.queue import Queued
from app.core.scoring import ScoringParams
from app.report.explain import explain, why_won
from app.report.story import Explanation
from app.store.engine import open_database
from tests.e2e.realistic_run import Run, realistic_run


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return realistic_run(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(run: Run) -> Iterator[Engine]:
    engine = open_database(run.db, upgrade=False)
    yield engine
    engine.dispose()


@pytest.fixture(scope="module")
def stories(run: Run, engine: Engine) -> dict[str, Explanation]:
    out = {}
    for name, request_id in run.ids.items():
        story = explain(engine, request_id)
        assert story is not None, name
        out[name] = story
    return out


def _recorded_scores(engine: Engine) -> dict[int, ev.ScoresComputed]:
    with engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT seq, data FROM events WHERE type = 'scores_computed'")
        decoded = {seq: ev.decode(data) for seq, data in rows}
    return {seq: e for seq, e in decoded.items() if isinstance(e, ev.ScoresComputed)}


def test_recomputed_scores_match_every_recorded_decision(
    run: Run, engine: Engine, stories: dict[str, Explanation]
) -> None:
    recorded = _recorded_scores(engine)
    with engine.connect() as conn:
        every_id = [r[0] for r in conn.exec_driver_sql("SELECT id FROM requests")]
    assert sorted(every_id) == sorted(run.ids.values())
    own_decisions = set()
    for name, story in stories.items():
        assert story.replay_matches, name
        for d in story.decisions:
            assert d.matches_record, (name, d.seq)
            scores = recorded[d.seq]
            assert d.winner_id == scores.request_id
            assert d.winner == scores.winner
            if d.winner_id == story.request_id:
                assert d.reason is None and d.score == scores.winner
                own_decisions.add(d.seq)
            else:
                assert d.reason is not None
            if scores.runner_up_id == story.request_id:
                assert d.score == scores.runner_up
    # Every recorded decision was recomputed in the story of the request it dispatched.
    assert own_decisions == set(recorded)
    assert len(recorded) == 10


def test_the_wait_splits_into_causes_that_add_up_to_the_measured_wait(
    engine: Engine, stories: dict[str, Explanation]
) -> None:
    with engine.connect() as conn:
        measured = dict(conn.exec_driver_sql("SELECT id, queue_wait_ms FROM requests").all())
    for name, story in stories.items():
        if story.status == "rejected":
            continue
        assert math.isclose(sum(p.seconds for p in story.wait), story.wait_s, abs_tol=1e-6), name
        if story.wait_s > 0:
            assert math.isclose(sum(p.percent for p in story.wait), 100.0, abs_tol=1e-6), name
        if story.dispatched_at is not None:
            assert math.isclose(story.wait_s * 1000, measured[story.request_id], abs_tol=0.01)


def test_a_normal_request_behind_a_long_job_bands_and_affinity(
    run: Run, stories: dict[str, Explanation]
) -> None:
    r1 = stories["r1"]
    ids = run.ids
    assert (r1.status, r1.model, r1.priority, r1.band, r1.caller) == (
        "completed",
        "B",
        0,
        "normal",
        "key#1",
    )
    assert [r.request_id for r in r1.running_at_arrival] == [ids["blocker1"]]
    assert r1.resident_at_arrival == "A"
    assert {a.request_id: a.reason for a in r1.ahead} == {
        ids["r5"]: "higher_band",
        ids["r4"]: "higher_band",
        ids["r2"]: "swap_affinity",
    }
    assert [d.winner_id for d in r1.decisions] == [ids["r5"], ids["r4"], ids["r2"], ids["r1"]]
    assert r1.own_swap is not None
    assert (r1.own_swap.from_model, r1.own_swap.to_model) == ("A", "B")
    assert r1.own_swap.duration_s is not None and r1.own_swap.duration_s > 0
    assert r1.run_s is not None and r1.started_at is not None
    assert r1.outcome is not None and r1.outcome.http_status == 200
    parts = {p.cause: p.seconds for p in r1.wait}
    assert parts["running_at_arrival"] > 0.5  # the 1.8 s job
    assert parts["higher_band"] > 0 and parts["swap_affinity"] > 0
    assert r1.total_s >= r1.wait_s + r1.own_swap.duration_s


def test_every_kind_of_reason_appears_where_the_run_put_it(
    run: Run, stories: dict[str, Explanation]
) -> None:
    ids = run.ids

    def reasons(name: str) -> dict[str, str]:
        return {a.request_id: a.reason for a in stories[name].ahead}

    assert reasons("r6")[ids["r1"]] == "arrived_earlier"
    assert reasons("r6")[ids["r2"]] == "swap_affinity"
    assert reasons("r4") == {ids["r5"]: "higher_tier"}
    assert reasons("r5") == {}
    assert set(reasons("r3").values()) == {"higher_band"}
    assert len(reasons("r3")) == 5
    assert reasons("r8") == {ids["r7"]: "aging"}
    # The batch request waited through r1's swap A -> B, and its own was B -> C.
    r3 = stories["r3"]
    assert [(s.from_model, s.to_model, s.request_id) for s in r3.swaps] == [("A", "B", ids["r1"])]
    assert r3.swaps[0].waited_s > 0
    assert r3.own_swap is not None and r3.own_swap.to_model == "C"
    assert {p.cause for p in r3.wait} >= {"running_at_arrival", "higher_band", "swaps"}
    r8 = stories["r8"]
    assert (r8.aging_divisor_s, r8.swap_affinity_bonus) == (0.004, 0)
    assert {p.cause for p in r8.wait} >= {"running_at_arrival", "aging"}


def test_cancelled_and_rejected_requests_say_how_they_ended(
    stories: dict[str, Explanation],
) -> None:
    gone = stories["cancelled"]
    assert gone.status == "cancelled" and gone.dispatched_at is None
    assert gone.outcome is not None and gone.outcome.cancel_reason == "client_gone"
    assert math.isclose(gone.wait_s, gone.total_s, abs_tol=1e-9)
    assert {p.cause for p in gone.wait} == {"running_at_arrival"}
    rejected = stories["rejected"]
    assert rejected.status == "rejected" and rejected.model is None
    assert rejected.outcome is not None and rejected.outcome.http_status == 404


def test_live_queue_and_a_waiting_requests_explanation(run: Run) -> None:
    ids = run.ids
    queue = run.live_queue
    assert queue["resident"] == "A" and queue["scheduler"] == "serial"
    assert [r["request_id"] for r in queue["running"]] == [ids["blocker2"]]
    assert queue["running"][0]["for_s"] > 0
    waiting = queue["waiting"]
    assert [(w["request_id"], w["position"], w["band"]) for w in waiting] == [
        (ids["r7"], 1, "batch"),
        (ids["r8"], 2, "interactive"),
    ]
    # Aging has already lifted the batch request above the interactive one.
    assert waiting[0]["score"]["total"] > waiting[1]["score"]["total"]
    assert waiting[0]["score"]["aging"] > 200
    starts = [w["estimated_start_at"] for w in waiting]
    assert queue["as_of"] <= starts[0] <= starts[1]
    assert all(w["waited_s"] > 0 for w in waiting)

    r8 = run.live_explain_r8
    assert r8["request_id"] == ids["r8"] and r8["status"] == "queued"
    assert r8["waiting"]["position"] == 2 and r8["waiting"]["queue_depth"] == 2
    assert r8["waiting"]["estimated_start_at"] >= r8["as_of"] - 0.5
    assert [r["request_id"] for r in r8["running_at_arrival"]] == [ids["blocker2"]]
    assert r8["queue_depth_at_arrival"] == 1 and r8["decisions"] == []
    assert math.isclose(sum(p["seconds"] for p in r8["wait"]), r8["wait_s"], abs_tol=1e-6)

    text = run.live_queue_text
    assert f"running: {ids['blocker2']} A normal" in text
    assert ids["r7"] in text and ids["r8"] in text


def test_http_explain_matches_the_cli_json(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["explain", run.ids["r1"], "--db", str(run.db), "--json"]) == 0
    from_cli = json.loads(capsys.readouterr().out)
    from_http = run.http_explain_r1
    for doc in (from_cli, from_http):
        doc.pop("as_of")
    assert from_http == from_cli
    assert run.http_explain_missing == 404


def test_cli_explain_tells_the_story_in_text(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["explain", run.ids["r6"], "--db", str(run.db)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"request {run.ids['r6']}: completed")
    assert "same score terms, arrived earlier" in text
    assert "its model was loaded (swap affinity)" in text
    assert "A -> B for " + run.ids["r1"] in text
    assert "behind the job running when it arrived" in text
    assert cli.main(["explain", "nope", "--db", str(run.db)]) == 1
    assert "no request 'nope'" in capsys.readouterr().err


def _queued(name: str, model: str, priority: int, enqueued_s: float, order: int) -> Queued:
    return Queued(name, model, priority, int(enqueued_s * 1e9), order)


@pytest.mark.parametrize(
    ("winner", "loser", "expected"),
    [
        (_queued("w", "A", 100, 5, 1), _queued("l", "A", 0, 0, 0), ["higher_band"]),
        (_queued("w", "A", 2, 5, 1), _queued("l", "B", 1, 0, 0), ["higher_tier", "swap_affinity"]),
        (_queued("w", "A", 0, 5, 1), _queued("l", "B", 0, 0, 0), ["swap_affinity"]),
        (_queued("w", "B", 0, 0, 0), _queued("l", "B", 0, 5, 1), ["arrived_earlier"]),
        (_queued("w", "B", -100, 0, 0), _queued("l", "B", 100, 900, 1), ["aging"]),
        (_queued("w", "A", -15, 0, 0), _queued("l", "B", 0, 900, 1), ["aging", "swap_affinity"]),
    ],
)
def test_why_won(winner: Queued, loser: Queued, expected: list[str]) -> None:
    params = ScoringParams(aging_divisor_ns=1_000_000_000, swap_affinity_bonus=10)
    assert why_won(params, winner, loser, {"A"}, winner.priority, loser.priority) == expected


def test_explanations_are_json(stories: dict[str, Explanation]) -> None:
    for story in stories.values():
        assert msgspec.json.decode(msgspec.json.encode(story), type=Explanation) == story
