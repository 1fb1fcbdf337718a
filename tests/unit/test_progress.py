"""Progress and an estimated finish for a run of jobs (app/report/progress.py):
the live queue's own estimates, with the figures they rest on."""

from __future__ import annotations

from app.core.scoring import NS_PER_S, ScoringParams
from app.report.progress import progress
from app.report.render import progress_text
from app.report.run_times import RunTimes
from tests.unit.core_driver import CoreDriver

TIMES = RunTimes({"a": 10.0, "b": 100.0}, {"a": 5.0, "b": 20.0}, 10.0, 5.0)


def test_a_run_ends_after_the_work_ahead_its_own_lines_and_the_swaps() -> None:
    d = CoreDriver(ScoringParams(), resident="a")
    d.enqueue("running", "a", 0)
    d.step()
    d.enqueue("urgent", "a", 100)  # goes first, on the model in use
    for i in range(3):
        d.enqueue(f"line{i}", "b", -100, caller="film")
    now = d.now
    p = progress(
        d.state,
        dict.fromkeys(d.state.running, now),
        now,
        TIMES,
        ["line0", "line1", "line2"],
        done=2,
        failed=1,
    )
    assert (p.total, p.done, p.failed, p.running, p.waiting) == (6, 2, 1, 0, 3)
    # running a: 10 s, urgent a: 10 s, load b: 20 s, three lines of b: 300 s.
    assert p.estimated_finish_in_s == 340.0
    assert p.estimated_finish_at == now / NS_PER_S + 340.0
    assert p.basis is not None
    assert (p.basis.ahead, p.basis.swaps) == (1, 1)
    assert p.basis.run_s == {"b": 100.0} and p.basis.swap_s == {"b": 20.0}


def test_running_lines_and_lines_not_queued_yet_count_too() -> None:
    d = CoreDriver(ScoringParams(), resident="a")
    d.enqueue("line0", "a", -100)
    d.step()
    d.advance(4 * NS_PER_S)
    now = d.now
    running_since = {"line0": now - 4 * NS_PER_S}
    lines = ["line0"]
    p = progress(d.state, running_since, now, TIMES, lines, done=0, failed=0, unqueued_models="aa")
    assert (p.total, p.running, p.waiting) == (3, 1, 2)
    assert p.estimated_finish_in_s == 6.0 + 20.0  # what is left of line0, then two runs
    assert p.basis is not None and p.basis.unqueued == 2 and p.basis.swaps == 0


def test_a_run_with_nothing_open_has_no_estimate() -> None:
    d = CoreDriver(ScoringParams(), resident="a")
    p = progress(d.state, {}, d.now, TIMES, ["gone"], done=3, failed=1)
    assert (p.total, p.done, p.failed, p.running, p.waiting) == (4, 3, 1, 0, 0)
    assert p.estimated_finish_at is None and p.basis is None


def test_a_chains_producer_gap_comes_before_each_shot_not_sent_yet() -> None:
    d = CoreDriver(ScoringParams(), resident="a")
    d.enqueue("shot0", "a", -100)
    now = d.now
    p = progress(d.state, {}, now, TIMES, ["shot0"], done=0, failed=0, unqueued_models="aaa")
    q = progress(
        d.state, {}, now, TIMES, ["shot0"], done=0, failed=0, unqueued_models="aaa", gap_s=2.0
    )
    assert p.estimated_finish_in_s == 40.0  # four runs of a
    assert q.estimated_finish_in_s == 40.0 + 3 * 2.0  # and the producer's gap before three


def test_a_run_behind_a_run_with_no_known_end_ends_at_the_earliest_said_so() -> None:
    # `other` runs a 10 s model 30 s in: past every run of a that the log read
    # (RunTimes has medians only), its end is open; the run's line waits behind it.
    d = CoreDriver(ScoringParams(), resident="a")
    d.enqueue("other", "a", 0)
    d.step()
    d.enqueue("line0", "a", -100, caller="film")
    now = d.now + 30 * NS_PER_S
    p = progress(d.state, {"other": d.now}, now, TIMES, ["line0"], done=0, failed=0)
    assert p.estimated_finish_open and p.estimated_finish_high_at is None
    assert p.estimated_finish_in_s == 10.0  # line0's own run: what is known to be left
    assert "ends after" in progress_text(p) and "at the earliest" in progress_text(p)
    # 5 s in, other's end is known: so is the finish.
    p = progress(
        d.state, {"other": d.now}, d.now + 5 * NS_PER_S, TIMES, ["line0"], done=0, failed=0
    )
    assert not p.estimated_finish_open and p.estimated_finish_in_s == 5.0 + 10.0
