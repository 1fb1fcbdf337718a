"""app/report/visibility.py: a user key's view of reports names no other caller."""

from __future__ import annotations

import msgspec

from app.core.scoring import Breakdown
from app.report.render import explanation_text
from app.report.story import Ahead, Decision, Explanation, RunningAtArrival, SwapWaited
from app.report.visibility import (
    ANOTHER_CALLER,
    event_data_seen_by,
    request_ids_in,
    story_seen_by,
    swaps_seen_by,
)

SCORE = Breakdown(priority=0, affinity=0, aging=1.0, total=1.0)


def swap(request_id: str | None, caller: str | None) -> SwapWaited:
    return SwapWaited("X", "Y", request_id, 1.0, 2.0, None, 2.0, caller=caller)


def story() -> Explanation:
    return Explanation(
        request_id="mine-1",
        model="Y",
        model_requested="Y",
        endpoint="/v1/chat/completions",
        caller="alice",
        priority=0,
        band="normal",
        attempt=1,
        status="completed",
        as_of=10.0,
        arrived_at=1.0,
        scheduler="serial",
        aging_divisor_s=60.0,
        swap_affinity_bonus=10,
        running_at_arrival=[RunningAtArrival("bob-1", "X", 0, "normal", 0.5, 1.0, caller="bob")],
        decisions=[
            Decision(3, 2.0, 2, "X", SCORE, "bob-2", "Y", SCORE, "arrived_earlier", True, "bob"),
            Decision(5, 4.0, 1, "Y", SCORE, "mine-1", "Y", SCORE, None, True, "alice"),
        ],
        ahead=[
            Ahead("bob-2", "Y", 0, "normal", 0.9, 2.0, "arrived_earlier", [], 1.5, caller="bob"),
            Ahead("mine-0", "Y", 0, "normal", 0.8, 3.0, "arrived_earlier", [], 0.5, "alice"),
        ],
        swaps=[swap("bob-2", "bob"), swap(None, None), swap("mine-0", "alice")],
        own_swap=swap("admin-1", None),
    )


def test_an_admin_sees_the_story_as_it_is() -> None:
    assert story_seen_by(story(), None) == story()


def test_a_user_sees_other_callers_work_as_another_callers_request() -> None:
    seen = story_seen_by(story(), "alice")
    text = msgspec.json.encode(seen).decode() + explanation_text(seen)
    for name in ("bob", "admin-1"):
        assert name not in text
    [running] = seen.running_at_arrival
    assert (running.request_id, running.caller, running.another_caller) == (None, None, True)
    assert [(a.request_id, a.another_caller) for a in seen.ahead] == [
        (None, True),
        ("mine-0", False),
    ]
    assert [(d.winner_id, d.winner_another_caller) for d in seen.decisions] == [
        (None, True),
        ("mine-1", False),
    ]
    # A preload stays a preload; its own swap, caused by someone else's request, hides it.
    assert [(s.request_id, s.another_caller) for s in seen.swaps] == [
        (None, True),
        (None, False),
        ("mine-0", False),
    ]
    assert seen.own_swap is not None and seen.own_swap.another_caller
    # What held it back is still told, with the same causes and times.
    assert seen.wait == story().wait and [a.held_s for a in seen.ahead] == [1.5, 0.5]
    assert f"{ANOTHER_CALLER} (X, normal)" in explanation_text(seen)


def test_timeline_swaps_lose_other_callers_ids_and_labels() -> None:
    rows = [
        {"seq": 1, "to_model": "X", "request_id": "bob-1", "caller": "bob"},
        {"seq": 2, "to_model": "Y", "request_id": None, "caller": None},
        {"seq": 3, "to_model": "X", "request_id": "mine-1", "caller": "alice"},
    ]
    assert swaps_seen_by(rows, "alice") == [
        {"seq": 1, "to_model": "X", "request_id": None, "caller": None, "another_caller": True},
        {"seq": 2, "to_model": "Y", "request_id": None, "caller": None, "another_caller": False},
        {
            "seq": 3,
            "to_model": "X",
            "request_id": "mine-1",
            "caller": "alice",
            "another_caller": False,
        },
    ]
    assert [r["request_id"] for r in swaps_seen_by(rows, None)] == ["bob-1", None, "mine-1"]


def test_a_raw_event_names_no_other_callers_request() -> None:
    data = {
        "type": "scores_computed",
        "request_id": "mine-1",
        "runner_up_id": "bob-1",
        "without_aging_id": "mine-2",
        "winner": {"priority": 0},
    }
    assert request_ids_in(data) == {"mine-1", "bob-1", "mine-2"}
    callers = {"mine-1": "alice", "mine-2": "alice", "bob-1": "bob"}
    assert event_data_seen_by(data, callers, "alice") == data | {"runner_up_id": ANOTHER_CALLER}
    assert event_data_seen_by(data, callers, None) == data
