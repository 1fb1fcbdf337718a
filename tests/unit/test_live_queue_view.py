"""The live queue view for HTTP routes (app/web/live_queue_view.py): a view that
walks the queue is computed in slices of a snapshot, so the run loop moves on
between them, and the answer is the view of the state as of the snapshot."""

from __future__ import annotations

import asyncio
import random
from typing import Any, cast

import pytest

from app.core.scoring import NS_PER_S, ScoringParams
from app.core.state import SchedulerState
from app.report.live_queue import SLICE, QueueView, queue_view
from app.runtime.api import LiveState
from app.runtime.scheduler import Scheduler
from app.web.live_queue_view import live_queue_view
from tests.unit.core_driver import CoreDriver
from tests.unit.test_live_queue import TIMES


class FakeScheduler:
    def __init__(self, driver: CoreDriver) -> None:
        self.driver = driver

    def live(self) -> LiveState:
        state = self.driver.state
        return LiveState(
            state=state, running_since=dict.fromkeys(state.running, 0), now_ns=self.driver.now
        )


@pytest.mark.parametrize(
    "window", [{}, {"caller": "y"}, {"first": 0, "count": 101}, {"first": 400, "count": 300}]
)
def test_a_view_is_the_snapshots_while_the_run_loop_moves_on(
    window: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(4)
    driver = CoreDriver(ScoringParams(fair_share_bonus=20, short_job_bonus=20), resident="a")
    driver.enqueue("running", "a", 0, caller="x")
    driver.step()
    for i in range(8 * SLICE):
        driver.advance(rng.randrange(3) * NS_PER_S)
        driver.enqueue(
            f"r{i}", rng.choice("ab"), rng.choice((100, 0, -100)), caller=rng.choice("xy")
        )
    expected: list[QueueView] = []
    snapshot = SchedulerState.snapshot

    def recording(state: SchedulerState) -> SchedulerState:
        copy = snapshot(state)
        running_since = dict.fromkeys(state.running, 0)
        expected.append(queue_view(copy, running_since, driver.now, TIMES, **window))
        return copy

    monkeypatch.setattr(SchedulerState, "snapshot", recording)

    async def main() -> tuple[QueueView, int]:
        moved = 0
        stop = asyncio.Event()

        async def run_loop() -> None:  # what the scheduler does meanwhile
            nonlocal moved
            while not stop.is_set():
                driver.complete(next(iter(driver.state.running)))
                driver.step()
                driver.advance(NS_PER_S)
                driver.enqueue(f"late{moved}", rng.choice("ab"), 100, caller="y")
                moved += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(run_loop())
        await asyncio.sleep(0)
        view = await live_queue_view(cast(Scheduler, FakeScheduler(driver)), TIMES, **window)
        stop.set()
        await task
        return view, moved

    view, moved = asyncio.run(main())
    if window.get("count") == 101:
        assert expected == []  # a first page ends in its first slice: no snapshot
        assert len(view.waiting) == 101
    else:
        assert [view] == expected
        assert moved > 2  # the run loop ran between the slices
