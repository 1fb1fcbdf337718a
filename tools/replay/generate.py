"""Synthetic workloads and logs: `python -m tools.replay generate SCENARIO --out DB`.

A scenario is a seeded workload (arrivals, priorities, models, run times, clients'
patience, chains) plus a swap-cost model. `generate` runs it through the same
simulation replay uses (so the log is a plausible history of the serial scheduler)
and writes the events it would have recorded into a new database, through the
store's own write path (`write_events`: events plus read models, one transaction).

Scenario `film` (the seeds' scenario), one working day per `--days`:

- a long-form render: 174 sequential ~4-minute batch shots on the video model, each
  submitted 0.5-3 s after the previous one finishes (caller `render`, tier +2);
- interactive image (flux) and video (wan) requests of 4-16 minutes, at random;
- interactive chat requests of seconds (qwen), at random;
- normal skill-tool calls (qwen, a few seconds to a minute), at random;
- twelve users on tiers 0..2 (priority = band + tier); interactive clients give up
  after 10-30 min (chat) or 30-90 min (image, video) in the queue;
- loads are warm (page cache) for the two most recently loaded models and 2-3x
  slower cold; every time jitters by 10%.

Scenario `fair` (two callers, one model), one burst per `--days`: member A submits
200 batch shots of 3-5 minutes at once (durable jobs, caller `member-a`), member B
20 such shots one minute later (`member-b`). Within a band the order is arrival
order, so without the fair-share term B waits behind all of A's work.

Every enqueue carries its caller and the expected run time the server would have
recorded (learnt from the run's own completed runs, see `tools.replay.simulate`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from app.core import events as ev
from app.core.scoring import NS_PER_S, ScoringParams
from app.core.state import SERIAL
from app.store.cursor import driver_cursor
from app.store.engine import open_database
from app.store.event_store import next_seq, write_events
from tools.replay.simulate import Policy, SwapCost, simulate, started_event
from tools.replay.workload import Request, SwapTimes, Workload

T0 = 1_736_150_400 * NS_PER_S
"""2025-01-06 08:00 UTC: the first working day."""
DAY = 86_400 * NS_PER_S
MIN = 60 * NS_PER_S

VIDEO, IMAGE, CHAT = "wan-video", "flux-image", "qwen-chat"
WARM_LOAD_S = {VIDEO: 45.0, IMAGE: 20.0, CHAT: 8.0}
UNLOAD_S = (2.0, 5.0)
PAGE_CACHE_MODELS = 2

SHOTS = 174
USERS = 12
WORKDAY = 14 * 60 * MIN


@dataclass(frozen=True)
class Scenario:
    workload: Workload
    swap_cost: SwapCost


class FilmSwapCost:
    """Warm load if the model is among the last PAGE_CACHE_MODELS loaded, else 2-3x slower."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed ^ 0x5A5A)
        self.cache: list[str] = []

    def __call__(self, from_model: str | None, to_model: str) -> tuple[int, int]:
        rng = self.rng
        warm = WARM_LOAD_S.get(to_model, 15.0)
        load = warm * rng.uniform(0.9, 1.1)
        if to_model not in self.cache:
            load *= rng.uniform(2.0, 3.0)
        else:
            self.cache.remove(to_model)
        self.cache.append(to_model)
        del self.cache[:-PAGE_CACHE_MODELS]
        unload = rng.uniform(*UNLOAD_S) if from_model is not None else 0.0
        return round(unload * NS_PER_S), round(load * NS_PER_S)


def film(seed: int, days: int = 1, limit: int | None = None) -> Scenario:
    """The seeds' scenario; `limit` keeps the first requests (benchmarks)."""
    rng = random.Random(seed)
    tiers = {f"user-{u}": u % 3 for u in range(USERS)}
    users = list(tiers)
    out: list[tuple[int, Request]] = []  # (planned arrival, request)
    serial = 0

    def rid() -> str:
        nonlocal serial
        serial += 1
        return f"{seed:08x}{serial:024x}"  # as long as a uuid4 hex

    def poisson(start: int, mean_gap_min: float) -> list[int]:
        times: list[int] = []
        t = start
        while True:
            t += round(rng.expovariate(1.0 / mean_gap_min) * MIN)
            if t >= start + WORKDAY:
                return times
            times.append(t)

    def interactive(
        day0: int,
        model: str,
        endpoint: str,
        gap: float,
        run: Callable[[], float],
        patience_min: tuple[float, float],
    ) -> None:
        for t in poisson(day0, gap):
            user = rng.choice(users)
            req = Request(
                rid(),
                model,
                100 + tiers[user],
                t,
                round(run() * NS_PER_S),
                patience_ns=round(rng.uniform(*patience_min) * MIN),
                endpoint=endpoint,
                caller=user,
            )
            out.append((t, req))

    for day in range(days):
        day0 = T0 + day * DAY
        # The render: each shot is submitted when the previous one finishes.
        planned = day0 + 5 * MIN
        prev = -1
        for _ in range(SHOTS):
            shot = Request(
                rid(),
                VIDEO,
                -100 + 2,
                planned,
                round(min(320.0, max(180.0, rng.gauss(240.0, 25.0))) * NS_PER_S),
                endpoint="/v1/video/generations",
                caller="render",
            )
            shot.think_ns = round(rng.uniform(0.5, 3.0) * NS_PER_S)
            shot.after = prev  # an index into `out` for now; renumbered below
            prev = len(out)
            out.append((planned, shot))
            planned += shot.run_ns + shot.think_ns
        interactive(
            day0, IMAGE, "/v1/images/generations", 50.0, lambda: rng.uniform(240, 960), (30, 90)
        )
        interactive(
            day0, VIDEO, "/v1/video/generations", 75.0, lambda: rng.uniform(240, 960), (30, 90)
        )
        interactive(
            day0,
            CHAT,
            "/v1/chat/completions",
            4.0,
            lambda: min(60.0, rng.lognormvariate(math.log(6.0), 0.8)),
            (10, 30),
        )
        for t in poisson(day0, 6.0):
            user = rng.choice(users)
            out.append(
                (
                    t,
                    Request(
                        rid(),
                        CHAT,
                        0 + tiers[user],
                        t,
                        round(rng.uniform(3.0, 45.0) * NS_PER_S),
                        endpoint="/v1/chat/completions",
                        caller=user,
                    ),
                )
            )
    # Arrival order; a chained request's planned time is after its predecessor's.
    position = sorted(range(len(out)), key=lambda i: out[i][0])
    new_index = {old: new for new, old in enumerate(position)}
    requests = []
    for old in position:
        r = out[old][1]
        if r.after >= 0:
            r.after = new_index[r.after]
        requests.append(r)
    if limit is not None and limit < len(requests):
        requests = requests[:limit]  # predecessors arrive earlier, so chains stay whole
    workload = Workload(
        requests=requests,
        swap_times=SwapTimes(
            load_ns={m: round(s * NS_PER_S) for m, s in WARM_LOAD_S.items()},
            unload_ns={m: round(3.5 * NS_PER_S) for m in WARM_LOAD_S},
        ),
        params=ScoringParams(),
    )
    return Scenario(workload, FilmSwapCost(seed))


FAIR_A_SHOTS = 200
FAIR_B_SHOTS = 20
FAIR_B_DELAY = 1 * MIN


def fair(seed: int, days: int = 1, limit: int | None = None) -> Scenario:
    """Two callers' batch work on one model: A's big burst, then B's small one."""
    rng = random.Random(seed)
    requests: list[Request] = []
    for day in range(days):
        day0 = T0 + day * DAY
        for caller, shots, at in (
            ("member-a", FAIR_A_SHOTS, day0),
            ("member-b", FAIR_B_SHOTS, day0 + FAIR_B_DELAY),
        ):
            for k in range(shots):
                requests.append(
                    Request(
                        f"{seed:08x}{len(requests) + 1:024x}",
                        VIDEO,
                        -100,
                        at + k * 1_000_000,  # one submission a millisecond: "at once"
                        round(rng.uniform(180.0, 300.0) * NS_PER_S),
                        endpoint="/v1/video/generations",
                        caller=caller,
                        durable=True,
                    )
                )
    if limit is not None:
        requests = requests[:limit]
    workload = Workload(
        requests=requests,
        swap_times=SwapTimes(load_ns={VIDEO: round(WARM_LOAD_S[VIDEO] * NS_PER_S)}),
        params=ScoringParams(),
    )
    return Scenario(workload, FilmSwapCost(seed))


SCENARIOS: dict[str, Callable[..., Scenario]] = {"film": film, "fair": fair}


def generate_events(
    scenario: Scenario,
    params: ScoringParams,
    scheduler: str = SERIAL,
    label: str = "film",
    *,
    policy: Policy | None = None,
) -> list[ev.AnyEvent]:
    """The events a server with `params` would have logged for this scenario; with
    `policy`, a server running that policy instead (`params` and `scheduler` unused):
    a reference policy's ground truth (`simulate.reference_policies`: the fifo
    scheduler, aging off, or every request enqueued at priority 0)."""
    workload = scenario.workload
    start = min((r.arrival_ns for r in workload.requests), default=T0) - NS_PER_S
    policy = policy or Policy("generate", params, scheduler=scheduler)
    # The log starts with the server_started whose fold is the simulation's state.
    started = started_event(
        policy,
        workload.models,
        start,
        version="replay-generate",
        config_hash=label,
        pid=1,
    )
    events: list[ev.AnyEvent] = []
    simulate(workload, policy, record=events, swap_cost=scenario.swap_cost, started=started)
    return events


def write_log(path: str | Path, events: list[ev.AnyEvent], batch: int = 10_000) -> None:
    """Append `events` to the database at `path` (created and migrated if new), in one
    transaction, projecting the read models as the server's writer does."""
    engine = open_database(path, synchronous="normal")
    try:
        with engine.connect() as conn:
            conn.execution_options(sqlite_begin="IMMEDIATE")
            with conn.begin():
                cur = driver_cursor(conn)
                first = next_seq(cur)
                for start in range(0, len(events), batch):
                    write_events(cur, first + start, events[start : start + batch])
    finally:
        engine.dispose()
