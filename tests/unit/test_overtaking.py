"""The forecast of work that overtakes a run (app/core/overtaking.py) and the
interval it gives a run's finish (app/report/progress.py), on hand-made logs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.core import events as ev
from app.core.lane_history import HOUR_NS, LaneHistory
from app.core.overtaking import BUSY_HOURS, QUIET_HOURS, forecast_finish
from app.core.scoring import NS_PER_S, ScoringParams
from app.core.state import SchedulerState, apply
from app.report.progress import progress
from app.report.render import progress_text
from app.report.run_times import RunTimes
from tests.unit.core_driver import CoreDriver

DAY = 24 * HOUR_NS
MIN = 60 * NS_PER_S
MONDAY_8 = 1_736_150_400 * NS_PER_S  # 2025-01-06 08:00 UTC, on an hour
RUN = -98  # the render's priority (batch, tier +2)


def busy_day(history: LaneHistory, day0: int, hours: int = 4, per_hour: int = 3) -> None:
    """From `day0`, `hours` hours in which `per_hour` interactive runs of 10
    minutes arrive each hour (half the lane), and a normal one of 5 minutes."""
    for h in range(hours):
        for i in range(per_hour):
            history.add_run(day0 + h * HOUR_NS + i * 20 * MIN, "image", 100, 10 * MIN)
        history.add_run(day0 + h * HOUR_NS + 5 * MIN, "chat", 0, 0)


def forecast(history: LaneHistory, now: int, work_ns: int, **kw: object) -> object:
    args: dict[str, object] = {"priority": RUN, "lane": {"video", "image", "chat"}}
    args |= {"run_models": {"video"}} | kw
    return forecast_finish(history, now, now + work_ns, **args)  # type: ignore[arg-type]


def test_the_same_hours_of_an_earlier_day_are_forecast_to_overtake_the_run() -> None:
    history = LaneHistory()
    history.begins(MONDAY_8 - HOUR_NS)
    busy_day(history, MONDAY_8)
    now = MONDAY_8 + DAY  # Tuesday 08:00: the busy hours are ahead
    f = forecast_finish(
        history, now, now + HOUR_NS, priority=RUN, lane={"video", "image"}, run_models={"video"}
    )
    # Half of each hour goes first: an hour of work takes two.
    assert abs(f.finish_ns - (now + 2 * HOUR_NS)) < NS_PER_S
    assert f.overtaking == 6 and f.earlier_days == 1
    assert f.low_ns < f.finish_ns
    assert f.high_ns is not None and f.high_ns > f.finish_ns


def test_quiet_hours_of_the_earlier_day_forecast_nothing() -> None:
    history = LaneHistory()
    history.begins(MONDAY_8 - HOUR_NS)
    busy_day(history, MONDAY_8)
    now = MONDAY_8 + DAY + 5 * HOUR_NS  # Tuesday 13:00: Monday was quiet from 12:00
    f = forecast_finish(
        history, now, now + HOUR_NS, priority=RUN, lane={"video", "image"}, run_models={"video"}
    )
    assert f.finish_ns == now + HOUR_NS and f.overtaking == 0


def test_only_higher_priorities_in_the_runs_lane_overtake() -> None:
    history = LaneHistory()
    history.begins(MONDAY_8 - HOUR_NS)
    for h in range(4):
        history.add_run(MONDAY_8 + h * HOUR_NS, "image", RUN, 30 * MIN)  # the same priority
        history.add_run(MONDAY_8 + h * HOUR_NS, "image", -100, 30 * MIN)  # lower
        history.add_run(MONDAY_8 + h * HOUR_NS, "other-gpu", 100, 30 * MIN)  # another lane
    now = MONDAY_8 + DAY
    f = forecast_finish(
        history, now, now + HOUR_NS, priority=RUN, lane={"video", "image"}, run_models={"video"}
    )
    assert f.finish_ns == now + HOUR_NS and f.overtaking == 0


def test_with_no_earlier_day_todays_rate_so_far_goes_on() -> None:
    history = LaneHistory()
    history.begins(MONDAY_8)
    busy_day(history, MONDAY_8, hours=2)  # two hours of today, half the lane busy
    now = MONDAY_8 + 2 * HOUR_NS
    f = forecast_finish(
        history, now, now + HOUR_NS, priority=RUN, lane={"video", "image"}, run_models={"video"}
    )
    # No earlier day: today's rate so far (half the lane) goes on, an hour of work takes two.
    assert abs(f.finish_ns - (now + 2 * HOUR_NS)) < NS_PER_S and f.earlier_days == 0
    assert f.overtaking == 6  # three image runs an hour
    # The rate is learnt from two hours only: a wide interval around the point.
    assert f.low_ns < now + 2 * HOUR_NS - 10 * MIN
    assert f.high_ns is not None and f.high_ns > now + 2 * HOUR_NS + 10 * MIN


def test_todays_busy_stretch_is_taken_to_end_busy_hours_after_it_began() -> None:
    history = LaneHistory()
    history.begins(MONDAY_8)
    busy_day(history, MONDAY_8, hours=BUSY_HOURS - 1)
    now = MONDAY_8 + (BUSY_HOURS - 1) * HOUR_NS
    f = forecast(history, now, 3 * HOUR_NS)
    # Half the lane for its last hour, then the lane is the run's: 3 h of work take 3.5.
    assert abs(f.finish_ns - (now + 3 * HOUR_NS + 30 * MIN)) < NS_PER_S  # type: ignore[attr-defined]
    # The interval's early end takes the stretch to end BUSY_SPREAD_HOURS sooner: now.
    assert f.low_ns == now + 3 * HOUR_NS  # type: ignore[attr-defined]


def test_a_log_too_short_to_forecast_from_gives_the_floor() -> None:
    # Less than half an hour of log: no rate to go on, the high end is unknown.
    now = MONDAY_8 + 2 * HOUR_NS
    young = LaneHistory()
    young.begins(now - 10 * MIN)
    young.add_run(now - 5 * MIN, "image", 100, 4 * MIN)
    f = forecast_finish(
        young, now, now + HOUR_NS, priority=RUN, lane={"video", "image"}, run_models={"video"}
    )
    assert f.finish_ns == now + HOUR_NS and f.high_ns is None
    assert f.overtaking == 0 and f.earlier_days == 0
    # After a quiet night (QUIET_HOURS without overtaking work), yesterday's evening
    # says nothing of today: nothing overtaking, the floor and its own spread.
    history = LaneHistory()
    history.begins(MONDAY_8)
    busy_day(history, MONDAY_8, hours=2)
    night = MONDAY_8 + (2 + QUIET_HOURS) * HOUR_NS
    f = forecast(history, night, HOUR_NS)
    assert f.finish_ns == night + HOUR_NS and f.overtaking == 0  # type: ignore[attr-defined]
    assert f.low_ns == f.high_ns == f.finish_ns  # type: ignore[attr-defined]
    # A stretch begun a few minutes ago has no rate yet: the high end is unknown.
    history.add_run(night + 5 * MIN, "image", 100, 10 * MIN)
    f = forecast(history, night + 10 * MIN, HOUR_NS)
    assert f.finish_ns == night + 70 * MIN and f.high_ns is None  # type: ignore[attr-defined]


def test_open_requests_count_in_todays_rate_so_far() -> None:
    history = LaneHistory()
    history.begins(MONDAY_8)
    busy_day(history, MONDAY_8, hours=2)
    now = MONDAY_8 + 2 * HOUR_NS
    f = forecast(history, now, HOUR_NS)
    # Three more image runs of 10 minutes arrived and have not ended: the history
    # has not learnt them yet, the rate so far counts them.
    more = [(now - 10 * MIN, "image", 100, 600.0)] * 3
    g = forecast(history, now, HOUR_NS, open_work=more)
    assert g.finish_ns > f.finish_ns + 10 * MIN  # type: ignore[attr-defined]
    # Not of the run's lane, or not of a higher priority: they do not overtake it.
    others = [(now - 10 * MIN, "elsewhere", 100, 600.0), (now - 10 * MIN, "image", RUN, 600.0)]
    assert forecast(history, now, HOUR_NS, open_work=others) == f


def test_a_runs_estimate_counts_others_open_requests_in_the_rate_so_far() -> None:
    history = LaneHistory()
    history.begins(MONDAY_8)
    busy_day(history, MONDAY_8, hours=2)
    d = CoreDriver(ScoringParams(), resident="video", now_ns=MONDAY_8 + 2 * HOUR_NS)
    d.enqueue("shot0", "video", RUN, caller="render")
    d.enqueue("img", "image", 100, caller="alice")  # waits for the shot
    args = (d.state, {}, d.now, TIMES, ["shot0"])
    floor = progress(*args, done=0, failed=0, unqueued_models=["video"] * 9)
    p = progress(*args, done=0, failed=0, unqueued_models=["video"] * 9, history=history)
    assert floor.estimated_finish_at is not None and p.estimated_finish_at is not None
    lane = {"video", "image", "chat"}
    alone = forecast_finish(
        history,
        d.now,
        round(floor.estimated_finish_at * NS_PER_S),
        priority=RUN,
        lane=lane,
        run_models={"video"},
    )
    assert p.estimated_finish_at > alone.finish_ns / NS_PER_S + 5 * 60


def test_a_busier_day_than_the_earlier_one_raises_the_forecast() -> None:
    history = LaneHistory()
    history.begins(MONDAY_8 - HOUR_NS)
    busy_day(history, MONDAY_8, hours=8, per_hour=1)  # a sixth of the lane
    calm = forecast_finish(
        history,
        MONDAY_8 + DAY + 3 * HOUR_NS,
        MONDAY_8 + DAY + 4 * HOUR_NS,
        priority=RUN,
        lane={"video", "image"},
        run_models={"video"},
    )
    busy_day(history, MONDAY_8 + DAY, hours=3, per_hour=3)  # today: half the lane so far
    busy = forecast_finish(
        history,
        MONDAY_8 + DAY + 3 * HOUR_NS,
        MONDAY_8 + DAY + 4 * HOUR_NS,
        priority=RUN,
        lane={"video", "image"},
        run_models={"video"},
    )
    assert busy.finish_ns > calm.finish_ns


def test_the_log_folded_event_by_event_feeds_runs_and_loads() -> None:
    d = CoreDriver(ScoringParams(), resident="video", now_ns=MONDAY_8)
    d.enqueue("shot", "video", RUN)
    d.step()
    d.apply(ev.RequestStarted(at=d.now, request_id="shot"))
    d.advance(4 * MIN)
    d.complete("shot")
    d.enqueue("img", "image", 100)
    d.step()
    d.start_swap("image", "img")
    d.advance(30 * NS_PER_S)
    d.apply(ev.SwapFinished(at=d.now, model="image", duration_ms=30_000.0))
    d.apply(ev.RequestStarted(at=d.now, request_id="img"))
    d.advance(10 * MIN)
    d.complete("img")
    d.enqueue("gone", "image", 100)
    d.cancel("gone")  # never ran: it took no lane time
    history = LaneHistory()
    state = SchedulerState()
    for e in d.log:
        history.observe(e, state)
        apply(state, e)
    taken = {k: (s.n, s.s) for k, s in history.hours[MONDAY_8 // HOUR_NS].items()}
    assert taken == {
        ("video", RUN, False): (1, 240.0),
        ("image", 100, False): (1, 600.0),
        ("image", 100, True): (1, 30.0),
        ("video", 0, True): (1, 0.0),  # the driver's first load, for no request
    }
    assert history.first_ns == d.log[0].at


def test_seeding_from_rows_learns_what_the_events_would() -> None:
    history = LaneHistory()
    history.learn(
        MONDAY_8 / NS_PER_S,
        [(MONDAY_8 / NS_PER_S + 60, "image", 100, 600_000.0)],
        [(MONDAY_8 / NS_PER_S + 30, "image", None, 30_000.0)],
    )
    taken = {k: (s.n, s.s) for k, s in history.hours[MONDAY_8 // HOUR_NS].items()}
    assert taken == {("image", 100, False): (1, 600.0), ("image", 0, True): (1, 30.0)}
    assert history.first_ns == MONDAY_8


TIMES = RunTimes({"video": 240.0, "image": 600.0}, {"video": 45.0, "image": 20.0}, 60.0, 30.0)


def test_a_runs_finish_adds_the_forecast_and_gives_an_interval() -> None:
    history = LaneHistory()
    history.begins(MONDAY_8 - HOUR_NS)
    busy_day(history, MONDAY_8, hours=12)
    d = CoreDriver(ScoringParams(), resident="video", now_ns=MONDAY_8 + DAY)
    d.enqueue("shot0", "video", RUN, caller="render")
    args = (d.state, {}, d.now, TIMES, ["shot0"])
    floor = progress(*args, done=0, failed=0, unqueued_models=["video"] * 9)
    p = progress(*args, done=0, failed=0, unqueued_models=["video"] * 9, history=history)
    # Ten shots of 4 minutes: 40 minutes as the queue stands ...
    assert floor.estimated_finish_in_s == 2400.0 and floor.estimated_finish_low_at is None
    assert p.estimated_finish_in_s is not None and p.estimated_finish_at is not None
    # ... but half the lane goes to the interactive work arriving meanwhile.
    assert abs(p.estimated_finish_in_s - 4800.0) < 1.0
    assert p.basis is not None and p.basis.overtaking >= 4 and p.basis.earlier_days == 1
    assert p.estimated_finish_low_at is not None and p.estimated_finish_high_at is not None
    assert p.estimated_finish_low_at < p.estimated_finish_at < p.estimated_finish_high_at
    now_s = d.now / NS_PER_S
    assert p.estimated_finish_low_in_s == pytest.approx(p.estimated_finish_low_at - now_s)
    assert p.estimated_finish_high_in_s == pytest.approx(p.estimated_finish_high_at - now_s)


def test_lines_not_queued_yet_take_the_mean_of_the_runs_own_jobs() -> None:
    history = LaneHistory()
    history.begins(MONDAY_8)
    for i in range(20):  # the render's shots so far: 200 s each, not the model's 240 s
        history.add_run(MONDAY_8 + i * MIN, "video", RUN, 200 * NS_PER_S)
    d = CoreDriver(ScoringParams(), resident="video", now_ns=MONDAY_8 + 2 * HOUR_NS)
    d.enqueue("shot0", "video", RUN, caller="render")
    p = progress(
        d.state, {}, d.now, TIMES, ["shot0"], done=20, failed=0, unqueued_models=["video"] * 5
    )
    q = progress(
        d.state,
        {},
        d.now,
        TIMES,
        ["shot0"],
        done=20,
        failed=0,
        unqueued_models=["video"] * 5,
        history=history,
    )
    assert p.estimated_finish_in_s == 240.0 * 6
    assert q.estimated_finish_in_s == 240.0 + 200.0 * 5


def test_the_one_line_of_a_run_shows_the_interval_and_the_overtaking_work() -> None:
    history = LaneHistory()
    history.begins(MONDAY_8 - HOUR_NS)
    busy_day(history, MONDAY_8, hours=12)
    d = CoreDriver(ScoringParams(), resident="video", now_ns=MONDAY_8 + DAY)
    d.enqueue("shot0", "video", RUN, caller="render")
    args = (d.state, {}, d.now, TIMES, ["shot0"])
    p = progress(*args, done=0, failed=0, unqueued_models=["video"] * 9, history=history)
    line = progress_text(p)
    assert "(in 1h20m, 80% in 40m00s to " in line and "overtaking" in line
    assert "no earlier day" not in line
    short = LaneHistory()
    short.begins(d.now - 10 * MIN)
    p = progress(*args, done=0, failed=0, unqueued_models=["video"] * 9, history=short)
    assert "(in 40m00s, 80% in 40m00s to ?)" in progress_text(p)
    assert "0 overtaking (no earlier day: from today's rate so far)" in progress_text(p)
    floor = progress(*args, done=0, failed=0, unqueued_models=["video"] * 9)
    assert "80%" not in progress_text(floor) and "overtaking" not in progress_text(floor)


Arrival = tuple[int, str, int, int, bool]  # (minute of the log, model, priority, seconds, load)
arrivals = st.lists(
    st.tuples(
        st.integers(0, 3 * 24 * 60 - 1),
        st.sampled_from(["video", "image", "elsewhere"]),
        st.sampled_from([-100, RUN, 0, 100]),
        st.integers(0, 1800),
        st.booleans(),
    ),
    max_size=60,
)


def learnt(found: list[Arrival]) -> LaneHistory:
    history = LaneHistory()
    history.begins(MONDAY_8)
    for minute, model, priority, seconds, load in found:
        add = history.add_load if load else history.add_run
        add(MONDAY_8 + minute * MIN, model, priority, seconds * NS_PER_S)
    return history


@settings(max_examples=150, deadline=None)
@given(
    found=arrivals,
    extra=st.tuples(st.integers(61, 23 * 60), st.integers(1, 3600)),
    now_min=st.integers(2 * 24 * 60, 3 * 24 * 60),
    work_s=st.integers(0, 20 * 3600),
    own_var=st.floats(0, 1e6),
)
def test_the_forecast_is_never_below_the_floor_and_the_interval_holds_the_point(
    found: list[Arrival],
    extra: tuple[int, int],
    now_min: int,
    work_s: int,
    own_var: float,
) -> None:
    now = MONDAY_8 + now_min * MIN
    floor = now + work_s * NS_PER_S
    kw = {"priority": RUN, "lane": {"video", "image"}, "run_models": {"video"}}
    f = forecast_finish(learnt(found), now, floor, own_var_s2=own_var, **kw)  # type: ignore[arg-type]
    assert f.finish_ns >= floor and f.low_ns <= f.finish_ns
    assert f.high_ns is None or f.high_ns >= f.finish_ns
    # More overtaking work today so far never brings the finish forward.
    more = [*found, (now_min - extra[0], "image", 100, extra[1], False)]
    g = forecast_finish(learnt(more), now, floor, own_var_s2=own_var, **kw)  # type: ignore[arg-type]
    assert g.finish_ns >= f.finish_ns


@settings(max_examples=150, deadline=None)
@given(
    found=arrivals,
    extra=st.tuples(st.integers(0, 59), st.integers(1, 3600)),
    now_min=st.integers(0, 24 * 60),
    work_s=st.integers(0, 20 * 3600),
)
def test_on_a_one_day_log_more_work_this_hour_never_brings_the_finish_forward(
    found: list[Arrival], extra: tuple[int, int], now_min: int, work_s: int
) -> None:
    now = MONDAY_8 + now_min * MIN
    today = [a for a in found if a[0] < now_min]
    floor = now + work_s * NS_PER_S
    kw = {"priority": RUN, "lane": {"video", "image"}, "run_models": {"video"}}
    f = forecast_finish(learnt(today), now, floor, **kw)  # type: ignore[arg-type]
    assert f.finish_ns >= floor and f.low_ns <= f.finish_ns
    assert f.high_ns is None or f.high_ns >= f.finish_ns
    # In the current clock hour: one in an earlier hour may start today's stretch
    # sooner (the log knows hours), spreading its work over a longer window.
    more = [*today, (now_min - extra[0] % (now_min % 60 + 1), "image", 100, extra[1], False)]
    g = forecast_finish(learnt(more), now, floor, **kw)  # type: ignore[arg-type]
    assert g.finish_ns >= f.finish_ns
