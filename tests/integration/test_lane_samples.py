"""The live server seeds its forecast of overtaking work from the log's rows
(app/store/samples.py `lane_samples`) at start, and learns from each event
afterwards: on a real SQLite log both must learn the same hours."""

from __future__ import annotations

from pathlib import Path

from app.core.lane_history import LaneHistory
from app.core.scoring import NS_PER_S, ScoringParams
from app.core.state import SchedulerState, apply
from app.store.engine import open_database
from app.store.samples import lane_samples
from tools.replay.generate import film, generate_events, write_log


def test_the_rows_read_at_start_learn_what_the_events_teach(tmp_path: Path) -> None:
    events = generate_events(film(7, limit=200), ScoringParams())
    db = tmp_path / "film.db"
    write_log(db, events)
    folded = LaneHistory()
    state = SchedulerState()
    for e in events:
        folded.observe(e, state)
        apply(state, e)
    seeded = LaneHistory()
    end = events[-1].at / NS_PER_S + 1
    seeded.learn(*lane_samples(open_database(db), 0.0, end))

    def table(h: LaneHistory) -> dict[tuple[int, str, int, bool], tuple[int, float]]:
        return {
            (hour, *key): (s.n, round(s.s, 3))
            for hour, sums in h.hours.items()
            for key, s in sums.items()
        }

    assert table(seeded) == table(folded)
    assert len(table(folded)) > 5  # runs and loads of several models and priorities
    assert seeded.first_ns is not None and folded.first_ns is not None
    assert abs(seeded.first_ns - folded.first_ns) < NS_PER_S // 1000  # seconds as floats
