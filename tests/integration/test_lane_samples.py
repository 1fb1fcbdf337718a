"""The live server seeds its forecast of overtaking work from the log's rows
(app/store/samples.py `lane_samples`) at start, and learns from each event
afterwards: on a real SQLite log both must learn the same hours, failed loads
and failed runs included."""

from __future__ import annotations

from pathlib import Path

from app.core import events as ev
from app.core.lane_history import LaneHistory
from app.core.scoring import NS_PER_S, ScoringParams
from app.core.state import SchedulerState, apply
from app.store.engine import open_database
from app.store.samples import lane_samples
from tests.unit.core_driver import CoreDriver
from tools.replay.generate import film, generate_events, write_log

Table = dict[tuple[int, str, int, bool], tuple[int, float]]


def table(h: LaneHistory) -> Table:
    return {
        (hour, *key): (s.n, round(s.s, 3))
        for hour, sums in h.hours.items()
        for key, s in sums.items()
    }


def folded_and_seeded(events: list[ev.AnyEvent], db: Path) -> tuple[LaneHistory, LaneHistory]:
    """What the events teach one by one, and what the log's rows teach at start."""
    write_log(db, events)
    folded = LaneHistory()
    state = SchedulerState()
    for e in events:
        folded.observe(e, state)
        apply(state, e)
    seeded = LaneHistory()
    end = events[-1].at / NS_PER_S + 1
    engine = open_database(db)
    try:
        seeded.learn(*lane_samples(engine, 0.0, end))
    finally:
        engine.dispose()
    return folded, seeded


def test_the_rows_read_at_start_learn_what_the_events_teach(tmp_path: Path) -> None:
    events = generate_events(film(7, limit=200), ScoringParams())
    folded, seeded = folded_and_seeded(events, tmp_path / "film.db")
    assert table(seeded) == table(folded)
    assert len(table(folded)) > 5  # runs and loads of several models and priorities
    assert seeded.first_ns is not None and folded.first_ns is not None
    assert abs(seeded.first_ns - folded.first_ns) < NS_PER_S // 1000  # seconds as floats


def test_failed_loads_teach_nothing_and_failed_runs_their_time_both_ways(tmp_path: Path) -> None:
    """A load that failed took no lane time a later load will take again; a run
    that failed took its time on the lane. The film has neither, so a log is
    made here with both, and runs that never started."""
    d = CoreDriver()
    s = NS_PER_S

    def run(
        rid: str,
        model: str,
        priority: int,
        load_s: float | None,
        run_s: float | None,
        *,
        load_fails: bool = False,
        run_fails: bool = False,
    ) -> None:
        d.enqueue(rid, model, priority)
        dispatched = d.step()
        assert dispatched is not None and dispatched.request_id == rid
        if dispatched.swap:
            assert load_s is not None
            d.start_swap(model, rid)
            d.advance(int(load_s * s))
            if load_fails:
                d.apply(
                    ev.SwapFailed(at=d.now, model=model, error="exit 1", duration_ms=load_s * 1e3)
                )
                d.apply(ev.RequestFailed(at=d.now, request_id=rid, error="load failed"))
                return
            d.apply(ev.SwapFinished(at=d.now, model=model, duration_ms=load_s * 1e3))
        assert run_s is not None
        d.apply(ev.RequestStarted(at=d.now, request_id=rid))
        d.advance(int(run_s * s))
        if run_fails:
            d.apply(ev.RequestFailed(at=d.now, request_id=rid, error="upstream 500"))
        else:
            d.apply(
                ev.RequestCompleted(at=d.now, request_id=rid, http_status=200, run_ms=run_s * 1e3)
            )

    run("a1", "a", 0, 2.0, 5.0)
    run("a2", "a", 10, None, 3.0, run_fails=True)  # a failed run: 3 s on the lane
    run("b1", "b", 0, 1.5, None, load_fails=True)  # a failed load: learns nothing
    run("b2", "b", 0, 4.0, 1.0)
    d.advance(3600 * s)  # the next hour
    run("b3", "b", 10, None, 7.0, run_fails=True)
    run("a3", "a", 0, 9.0, None, load_fails=True)
    run("a4", "a", 0, 2.5, 2.0)
    failed_loads = [e for e in d.log if isinstance(e, ev.SwapFailed)]
    failed_runs = [e for e in d.log if isinstance(e, ev.RequestFailed)]
    assert len(failed_loads) == 2 and len(failed_runs) == 4

    folded, seeded = folded_and_seeded(d.log, tmp_path / "failures.db")
    assert table(seeded) == table(folded)
    # What each learnt: the successful loads and every run that ran, failed or not.
    loads = sorted(v for k, v in table(folded).items() if k[3])
    runs = sorted(v for k, v in table(folded).items() if not k[3])
    assert loads == [(1, 2.0), (1, 2.5), (1, 4.0)]
    assert runs == [(1, 1.0), (1, 2.0), (1, 3.0), (1, 5.0), (1, 7.0)]
