"""A waiting request's place (app/runtime/places.py): the live queue's order, found
only when asked and kept while the state does not change."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from app.core.policy import ahead_of
from app.core.scoring import NS_PER_S, ScoringParams
from app.report.live_queue import durations, queue_view
from app.runtime import places
from app.runtime.api import LiveState
from app.runtime.places import Places
from tests.unit.core_driver import CoreDriver
from tests.unit.test_live_queue import TIMES


class Loop:
    """What `Places` reads of the run loop: its live state and its version."""

    def __init__(self, driver: CoreDriver) -> None:
        self.driver = driver
        self.version = 0

    def live(self) -> LiveState:
        state = self.driver.state
        return LiveState(
            state=state, running_since=dict.fromkeys(state.running, 0), now_ns=self.driver.now
        )

    def places(self) -> Places:
        return Places(self.live, lambda: self.version, lambda: durations(TIMES))


def swap_ahead() -> CoreDriver:
    """A runs; b1 beats a1 (15 to 0 + the bonus 10), and once the queue has swapped
    to B for b1, b2 (5 + 10) goes before a1 (0): the next decision's order is b1,
    a1, b2, the simulated one (the queue page's) b1, b2, a1."""
    d = CoreDriver(ScoringParams(swap_affinity_bonus=10, aging_divisor_ns=0), resident="a")
    d.enqueue("running", "a", 0)
    d.step()
    d.enqueue("b1", "b", 15)
    d.enqueue("a1", "a", 0)
    d.enqueue("b2", "b", 5)
    return d


def test_a_place_is_the_queue_pages_position_not_the_next_decisions_rank() -> None:
    d = swap_ahead()
    loop = Loop(d)
    view = queue_view(d.state, loop.live().running_since, d.now, TIMES)
    page = {w.request_id: w.position - 1 for w in view.waiting}
    assert page == {"b1": 0, "b2": 1, "a1": 2}
    assert ahead_of(d.state, "b2") == 2  # the next decision ranks it last
    found = {rid: asyncio.run(loop.places().ahead(rid)) for rid in page}
    assert found == page
    assert asyncio.run(loop.places().ahead("running")) is None
    assert asyncio.run(loop.places().ahead("nobody")) is None


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every walk of the queue `Places` starts."""
    started: list[Any] = []
    real = places.start_steps

    def counted(*args: Any, **kw: Any) -> Any:
        started.append(kw.get("wanted"))
        return real(*args, **kw)

    monkeypatch.setattr(places, "start_steps", counted)
    return started


def test_polls_between_two_changes_walk_the_queue_once(walks: list[Any]) -> None:
    d = CoreDriver(ScoringParams(), resident="a")
    d.enqueue("running", "a", 0)
    d.step()
    for i in range(600):
        d.enqueue(f"r{i}", "a", 0)
    loop = Loop(d)
    known = loop.places()

    def poll(*numbers: int) -> list[int | None]:
        """Places of these requests, and whether any poll walked the queue."""
        before = len(walks)
        found = [asyncio.run(known.ahead(f"r{i}")) for i in numbers]
        found.append(len(walks) > before)
        return found

    # The deepest first: its walk places every one before it too.
    assert poll(599) == [599, True]
    assert poll(0, 300, 599) == [0, 300, 599, False]
    # The state moves on (one more emit): the next poll walks again.
    d.cancel("r0")
    loop.version += 1
    assert poll(599) == [598, True]
    assert poll(599, 1) == [598, 0, False]
    # So does the clock, past TTL_NS, with the state as it was.
    d.advance(NS_PER_S)
    assert poll(599) == [598, True]
