"""The console's queue rows as data (app/web/console/queue_page.py) and the history
chart's percentiles (wait_percentiles.py): the words a user reads for why a
request waits, and the figures the chart draws."""

from __future__ import annotations

import msgspec

from app.core.scoring import Breakdown
from app.report.live_queue import QueueView, RunningEntry, WaitingEntry
from app.report.waits import WaitsFor
from app.web.console.queue_page import queue_page, reason, score_terms
from app.web.console.wait_percentiles import wait_percentiles


def waiting(
    position: int,
    model: str,
    priority: int = 0,
    *,
    aging: float = 0.0,
    affinity: int = 0,
    fair: float = 0.0,
    short: float = 0.0,
    caller: str | None = None,
) -> WaitingEntry:
    total = priority + affinity + aging + fair + short
    score = Breakdown(priority, affinity, aging, total, fair_share=fair, short_job=short)
    return WaitingEntry(
        position=position,
        request_id=f"r{position}",
        model=model,
        priority=priority,
        band="normal",
        score=score,
        enqueued_at=0.0,
        waited_s=1.0,
        estimated_start_at=10.0 * position,
        estimated_start_in_s=10.0 * position,
        caller=caller,
    )


def view(
    rows: list[WaitingEntry],
    *,
    resident: str | None = "a",
    loading: str | None = None,
    running: bool = True,
) -> QueueView:
    run = [RunningEntry("x", "a", 0, "normal", 0.0, 1.0, False, "c")] if running else []
    return QueueView(
        as_of=0.0,
        scheduler="serial",
        resident=resident,
        loading=loading,
        aging_divisor_s=60.0,
        swap_affinity_bonus=10,
        running=run,
        waiting=rows,
    )


def test_the_head_of_the_queue_says_what_it_waits_for() -> None:
    head = waiting(1, "a")
    assert reason(view([head]), head, None) == "next: waits for the running job"
    other = waiting(1, "b")
    assert reason(view([other]), other, None) == "next: waits for the running job, then a swap to b"
    assert reason(view([other], loading="b"), other, None) == "next: its model b is loading"
    assert (
        reason(view([other], resident=None, loading="c"), other, None)
        == "next: waits for the swap to c, then a swap to b"
    )
    idle = view([head], running=False)
    assert reason(idle, head, None) == "next: about to start"


def test_a_row_names_the_term_that_put_the_request_ahead_of_it() -> None:
    ahead = waiting(1, "a", 100)
    behind = waiting(2, "a", 0, aging=0.5)
    assert reason(view([ahead, behind]), behind, ahead) == "behind a higher score (priority +100)"
    fair_ahead = waiting(1, "a", 0, fair=20.0)
    assert reason(view([fair_ahead, behind]), behind, fair_ahead).startswith(
        "behind a higher score (fair_share +20"
    )
    short_ahead = waiting(1, "b", 0, short=18.2)
    row = waiting(2, "b", 0, short=4.0)
    assert reason(view([short_ahead, row]), row, short_ahead) == (
        "behind a higher score (short_job +14.20); needs a swap to b"
    )
    same = waiting(1, "a")
    twin = waiting(2, "a")
    assert reason(view([same, twin]), twin, same) == "behind an equal score that arrived earlier"
    # The rows follow the simulated dispatch: after a swap to b, b's next request
    # goes before a higher one for a (b is in use by then).
    b_next = waiting(2, "b", 0)
    a_later = waiting(3, "a", 5)
    assert reason(view([b_next, a_later]), a_later, b_next) == (
        "behind a lower score for b, in use by then (swap affinity)"
    )


def test_every_score_term_is_a_column_and_a_user_sees_only_its_rows() -> None:
    rows = [waiting(1, "a", 100, caller="alice"), waiting(2, "b", 0, caller="bob")]
    page = queue_page(view(rows), 0, 100, caller="bob")
    assert score_terms(view(rows)) == [
        "priority",
        "affinity",
        "aging",
        "fair_share",
        "short_job",
    ]
    assert [r["request_id"] for r in page["waiting"]] == ["r2"]
    assert page["waiting"][0]["position"] == 2  # its place in the whole queue
    assert page["waiting"][0]["reason"].startswith("behind a higher score (priority +100)")
    assert page["total_waiting"] == 1
    assert page["running"] == []  # the running job is caller c's


def test_each_row_says_what_it_waits_for_and_a_user_sees_no_other_callers_request() -> None:
    slot = WaitsFor("slot", "a")
    drain = WaitsFor("drain", "a", "r1", "alice")
    rows = [
        msgspec.structs.replace(waiting(1, "b", 100, caller="alice"), waits_for=drain),
        msgspec.structs.replace(waiting(2, "a", caller="bob"), waits_for=slot),
        msgspec.structs.replace(waiting(3, "a", caller="bob"), waits_for=drain),
    ]
    admin = queue_page(view(rows), 0, 100)
    assert [r["waits_for"]["text"] for r in admin["waiting"]] == [
        "a to drain for r1",
        "a free slot of a",
        "a to drain for r1",
    ]
    assert admin["waiting"][0]["waits_for"]["for_caller"] == "alice"
    bob = queue_page(view(rows), 0, 100, caller="bob")
    seen = [r["waits_for"] for r in bob["waiting"]]
    assert [w["text"] for w in seen] == [
        "a free slot of a",
        "a to drain for another caller's request",
    ]
    assert seen[1]["for_request"] is None and seen[1]["for_caller"] is None
    # Two models in use (resident says the last one loaded): a free slot of its own
    # model needs no swap, whatever `resident` says.
    (first,) = queue_page(view([rows[1]], resident="c"), 0, 100)["waiting"]
    assert first["reason"] == "next: waits for the running job"
    unknown = queue_page(view([waiting(1, "a")]), 0, 100)
    assert unknown["waiting"][0]["waits_for"] is None


def test_wait_percentiles_per_band_by_nearest_rank() -> None:
    samples = [("batch", 4000.0), ("interactive", 100.0)] + [
        ("interactive", ms) for ms in (200.0, 300.0, 400.0)
    ]
    figures = wait_percentiles(samples)
    assert list(figures) == ["interactive", "batch"]
    assert figures["interactive"] == {"count": 4, "p50": 0.2, "p90": 0.4, "p99": 0.4}
    assert figures["batch"] == {"count": 1, "p50": 4.0, "p90": 4.0, "p99": 4.0}
    assert wait_percentiles([]) == {}
