"""The host-memory budget for sleepers (`app.core.sleep_budget`): who sleeps, who
is stopped to make room."""

from __future__ import annotations

from app.core.sleep_budget import Sleeper, SleepRoom, make_room

GIB = 1 << 30


def test_no_budget_always_sleeps() -> None:
    assert make_room(100 * GIB, [Sleeper("a", 50 * GIB, 1)], None) == SleepRoom(sleep=True)


def test_a_model_that_alone_passes_the_budget_is_stopped_instead() -> None:
    assert make_room(17 * GIB, [], 16 * GIB) == SleepRoom(sleep=False)


def test_the_longest_asleep_are_stopped_first_until_it_fits() -> None:
    sleepers = [
        Sleeper("new", 8 * GIB, 30),
        Sleeper("old", 8 * GIB, 10),
        Sleeper("mid", 8 * GIB, 20),
    ]
    assert make_room(8 * GIB, sleepers, 24 * GIB) == SleepRoom(sleep=True, stop=("old",))
    assert make_room(16 * GIB, sleepers, 24 * GIB) == SleepRoom(sleep=True, stop=("old", "mid"))
    assert make_room(0, sleepers, 24 * GIB) == SleepRoom(sleep=True)
