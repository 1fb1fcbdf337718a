"""The work that will overtake a run: learnt from the log, forecast by the hour.

A run of jobs (a batch, a chain) waits behind whatever arrives later with a
higher score. The queue as it stands (app/core/start_estimate.py) cannot see
that work; this module forecasts it from what the log holds, as a term the
run-level estimate adds (app/report/progress.py). `Retry-After` and the live
queue's starts stay the queue as it stands.

`LaneHistory` (app/core/lane_history.py) holds, per hour of the log, the lane
time taken by the work that arrived in that hour, by model and priority.

`forecast_finish` plays time forward from now, hour by hour. The lane time
each future hour loses to overtaking work (arrivals of a higher priority on
a model of the run's lane, their loads, and the reloads of the run's own
models after them) is the mean of the same hour of the earlier days the log
covers (at most `DAYS`). The run ends when the lane time left to it reaches
the work the queue-as-it-stands estimate gives it (`floor_ns - now_ns`):
the least T with T - now - overtaking(now, T) = work.

The interval (80%) treats the overtaking work as compound Poisson: its
variance is the sum of the squares of its runs and loads (as the earlier days
saw them, times 1 + 1/days for a mean learnt from few days), plus the spread
of the run's own jobs.

An hour no earlier day covers (a log shorter than a day) is forecast from
today's busy stretch: the overtaking work that arrived since it began (after
`QUIET_HOURS` without any, or the log's start; open requests counted at their
expected run) goes on at its rate so far until `BUSY_HOURS` after it began,
with the variance of a rate learnt from that window added. The interval's
ends take the stretch to end `BUSY_SPREAD_HOURS` sooner and later. Past its
end nothing overtaking is forecast. With less than `MIN_OBSERVED_NS` of the
stretch (or of log) there is no rate yet: the point and the low end forecast
nothing, the high end is unknown.

Pure: no clock (`now_ns` is an argument), no I/O, floats only for estimates.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from typing import Final, NamedTuple

from app.core.lane_history import DAY_HOURS, DAYS, HOUR_NS, LaneHistory
from app.core.scoring import NS_PER_S

Z80: Final = 1.2816
"""A normal's 90th percentile in standard deviations: the 80% interval's ends."""
MIN_OBSERVED_NS: Final = 30 * 60 * NS_PER_S
"""Less of today's stretch (or of log) than this: no rate yet, the high end is unknown."""
MAX_LEVEL: Final = 2.0
"""Today against the earlier days moves the forecast at most to double or half."""
BUSY_HOURS: Final = 14
"""With no earlier day, today's busy stretch is taken to last this long from its
first overtaking work (a working day and its evening)."""
BUSY_SPREAD_HOURS: Final = 4
"""The interval's early end takes the stretch to end this much sooner, its late
end this much later."""
QUIET_HOURS: Final = 4
"""Hours without overtaking work that end a busy stretch (a night)."""
HORIZON_HOURS: Final = 60 * DAY_HOURS
"""A run not done within this many hours of forecast has no finish (None)."""


class Forecast(NamedTuple):
    finish_ns: int
    low_ns: int
    high_ns: int | None
    """None: unknown (no rate yet to forecast from, or no end within the horizon)."""
    overtaking: int
    """Expected arrivals that go first before the point estimate."""
    earlier_days: int
    """The fewest earlier days any forecast hour rested on (0: some hour had none)."""


class _Hour(NamedTuple):
    mean: float
    var: float
    runs: float
    days: int


class _Today(NamedTuple):
    """Today's rate so far (lane time and runs per second of `window_s`, and the
    observed sum of squares), going on from `now_ns`; the stretch began at
    `start_ns`."""

    rate: float
    s2: float
    runs: float
    window_s: float
    now_ns: int
    start_ns: int

    def over(self, a: int, b: int) -> tuple[float, float, float]:
        """(mean, variance, runs) of the overtaking work arriving from `a` to `b`.
        The variance is the future's own (compound Poisson) plus that of a rate
        learnt from `window_s`, which is the same for every hour ahead: the
        total's, S2·(H/W + (H/W)²) at H from now, taken piecewise."""
        if b <= a or self.window_s <= 0:
            return 0.0, 0.0, 0.0

        def var(x: int) -> float:
            f = (x - self.now_ns) / NS_PER_S / self.window_s
            return self.s2 * (f + f * f)

        length_s = (b - a) / NS_PER_S
        return self.rate * length_s, var(b) - var(a), self.runs * length_s


class _Segment(NamedTuple):
    """Part of an hour, from `a` to `b`, over which overtaking work (its mean `m`
    and variance `v` in the segment) accrues evenly, after `mean`, `var` before."""

    a: int
    b: int
    now_ns: int
    mean: float
    var: float
    m: float
    v: float
    z: float

    def free(self, x: int) -> float:
        """Lane time left to the run from now to `x` (s), at the z-quantile."""
        f = (x - self.a) / (self.b - self.a)
        taken_s = self.mean + self.m * f + self.z * math.sqrt(self.var + self.v * f)
        return (x - self.now_ns) / NS_PER_S - max(0.0, taken_s)


def forecast_finish(
    history: LaneHistory,
    now_ns: int,
    floor_ns: int,
    *,
    priority: int,
    lane: Collection[str],
    run_models: Collection[str],
    own_var_s2: float = 0.0,
    open_work: Iterable[tuple[int, str, int, float]] = (),
) -> Forecast:
    """When a run whose jobs have `priority` ends, given that the queue as it
    stands has it end at `floor_ns`: work arriving later at a higher priority on
    a model of `lane` (the models sharing the run's lane) goes first, with its
    loads and the reloads of `run_models` after it. `own_var_s2`: the variance of
    the run's own remaining work (s²). `open_work`: (arrived at, model, priority,
    expected run s) of requests queued or running now, which the history learns
    only once they end: today's rate so far counts them too."""
    now_hour = now_ns // HOUR_NS
    first = history.first_ns if history.first_ns is not None else now_ns
    lane_set, own = frozenset(lane), frozenset(run_models)
    opened = [(at, s) for at, model, p, s in open_work if model in lane_set and p > priority]

    def taken(hour: int) -> tuple[float, float, float]:
        """(seconds, seconds², runs) of overtaking work that arrived in `hour`."""
        s = s2 = n = 0.0
        for (model, p, load), sums in history.hours.get(hour, {}).items():
            if model not in lane_set:
                continue
            if p > priority or (load and model in own):
                s += sums.s
                s2 += sums.s2
                n += 0 if load else sums.n
        return s, s2, n

    # Today's busy stretch: from the first hour with overtaking work after the last
    # QUIET_HOURS without any (or the log's start) to BUSY_HOURS later. For hours
    # of it no earlier day covers, its rate so far goes on.
    quiet = 0
    busy_hour = None
    for h in range(now_hour, first // HOUR_NS - 1, -1):
        if taken(h)[0] > 0:
            busy_hour, quiet = h, 0
        else:
            quiet += 1
            if quiet >= QUIET_HOURS:
                break
    today = _Today(0.0, 0.0, 0.0, 0.0, now_ns, now_ns)  # no stretch: nothing goes on
    rate_known = now_ns - first >= MIN_OBSERVED_NS
    if busy_hour is not None:
        start = max(first, busy_hour * HOUR_NS)
        window_s = (now_ns - start) / NS_PER_S
        rate_known = now_ns - start >= MIN_OBSERVED_NS
        if rate_known:
            sums = [taken(h) for h in range(busy_hour, now_hour + 1)]
            sums += [(s, s * s, 1.0) for at, s in opened if at >= busy_hour * HOUR_NS]
            today = _Today(
                sum(t[0] for t in sums) / window_s,
                sum(t[1] for t in sums),
                sum(t[2] for t in sums) / window_s,
                window_s,
                now_ns,
                start,
            )

    memo: dict[int, _Hour] = {}

    def same_hours(hour: int) -> _Hour:
        """`hour` as the same hour of the earlier days saw it (before now)."""
        found = memo.get(hour)
        if found is None:
            past = [
                taken(h)
                for h in range(hour - DAY_HOURS, now_hour - DAYS * DAY_HOURS - 1, -DAY_HOURS)
                if h < now_hour and h * HOUR_NS + HOUR_NS // 2 >= first
            ]
            if past:
                days = len(past)
                mean = sum(p[0] for p in past) / days
                var = sum(p[1] for p in past) / days * (1 + 1 / days)
                found = _Hour(mean, var, sum(p[2] for p in past) / days, days)
            else:
                found = _Hour(0.0, 0.0, 0.0, 0)
            memo[hour] = found
        return found

    # Today so far against the same hours of the earlier days: a busier day than
    # they were moves the forecast's level, weighted as one more day among them.
    # The last hour is left out: work that arrived then may not have ended yet.
    seen = expected = 0.0
    weight = 0
    for h in range(now_hour - DAY_HOURS, now_hour - 1):
        before = same_hours(h)
        if before.days and h * HOUR_NS + HOUR_NS // 2 >= first:
            seen += taken(h)[0]
            expected += before.mean
            weight = max(weight, before.days)
    level = (weight * expected + seen) / ((weight + 1) * expected) if expected > 0 else 1.0
    level = min(MAX_LEVEL, max(1 / MAX_LEVEL, level))  # a few odd hours do not swamp it

    def hour_of(hour: int) -> _Hour:
        h = same_hours(hour)
        return _Hour(h.mean * level, h.var * level, h.runs * level, h.days)

    work_s = max(0.0, (floor_ns - now_ns) / NS_PER_S)
    own_sd = math.sqrt(max(0.0, own_var_s2))
    lowest_days = [DAYS]

    def crossing(z: float, busy_hours: int, point: bool) -> tuple[int, float] | None:
        """The least T where the lane time left to the run reaches its work (at
        the z-quantile of both), and the overtaking runs expected until then,
        today's busy stretch taken to last `busy_hours`."""
        need = max(0.0, work_s + z * own_sd)
        mean = var = count = 0.0
        for hour in range(now_hour, now_hour + HORIZON_HOURS):
            a = max(now_ns, hour * HOUR_NS)
            b = (hour + 1) * HOUR_NS
            share = (b - a) / HOUR_NS
            h = hour_of(hour)
            if h.days:
                m, v, c = h.mean * share, h.var * share, h.runs * share
            else:
                until = max(a, min(b, today.start_ns + busy_hours * HOUR_NS))
                m, v, c = today.over(a, until)
            if point:
                lowest_days[0] = min(lowest_days[0], h.days)

            seg = _Segment(a, b, now_ns, mean, var, m, v, z)
            if seg.free(b) >= need:
                if z == 0.0 or (var == 0.0 and v == 0.0):  # linear in x: solved exactly
                    start, end = seg.free(a), seg.free(b)
                    x = (
                        b
                        if end == start
                        else a + math.ceil((need - start) / (end - start) * (b - a))
                    )
                    x = min(b, max(a, x))
                    return x, count + c * (x - a) / (b - a)
                lo, hi = a, b
                while hi - lo > NS_PER_S // 1000:  # to the millisecond
                    mid = (lo + hi) // 2
                    if seg.free(mid) >= need:
                        hi = mid
                    else:
                        lo = mid
                return hi, count + c * (hi - a) / (b - a)
            mean, var, count = mean + m, var + v, count + c
        return None

    point = crossing(0.0, BUSY_HOURS, True)
    low = crossing(-Z80, BUSY_HOURS - BUSY_SPREAD_HOURS, False)
    high = (
        crossing(Z80, BUSY_HOURS + BUSY_SPREAD_HOURS, False)
        if rate_known or lowest_days[0]
        else None
    )
    if point is None:  # overtaking work fills the lane for the whole horizon
        return Forecast(floor_ns, min(floor_ns, low[0] if low else floor_ns), None, 0, 0)
    finish = point[0]
    low_ns = min(finish, low[0] if low is not None else finish)
    high_ns = None if high is None else max(finish, high[0])
    return Forecast(finish, low_ns, high_ns, round(point[1]), lowest_days[0])
