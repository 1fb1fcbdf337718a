"""How a restart folds (app/core/state.py): a new process's queue is what its recovery
records, and `server_started` carries every parameter a decision depends on."""

from __future__ import annotations

from app.core import events as ev
from app.core.scoring import NS_PER_S, ScoringParams
from app.core.state import FIFO, SchedulerState, apply
from app.store.invariants import audit
from tests.unit.core_driver import T0, CoreDriver, snapshot

S = NS_PER_S
MIN = 60 * S


def history() -> CoreDriver:
    """No aging, no bonus (ties are arrival order): a durable job running on A, then a
    synchronous request and three durable jobs waiting."""
    d = CoreDriver(ScoringParams(0, 0), resident="A")
    d.enqueue("run", "A", durable=True)
    assert d.dispatch_all() == ["run"]
    for rid, model, priority, durable in [
        ("sync", "A", 0, False),
        ("j1", "B", 0, True),
        ("j2", "A", 5, True),
        ("j3", "B", 0, True),
    ]:
        d.advance(S)
        d.enqueue(rid, model, priority, durable=durable)
    d.advance(S)
    return d


def queued(state: SchedulerState) -> list[str]:
    return [q.request_id for q in state.queue.ranked(state.resident)]


def restored(request_id: str, at: int, enqueued_at: int, priority: int = 0) -> ev.RequestRestored:
    return ev.RequestRestored(
        at=at, request_id=request_id, model="A", priority=priority, enqueued_at=enqueued_at
    )


def test_a_new_process_starts_with_nothing_queued_running_or_loaded() -> None:
    d = history()
    d.start_server(ScoringParams(0, 0))
    state = d.state
    assert (state.requests, len(state.queue), state.running) == ({}, 0, {})
    assert (state.resident, state.loading) == (None, None)
    assert d.step() is None


def test_recovery_puts_the_durable_jobs_back_and_the_running_one_keeps_its_place() -> None:
    # No aging: only arrival order breaks the tie between "run" (first) and j1, j3.
    d = history()
    d.restart()
    recovered = [
        (type(e).__name__, e.request_id)
        for e in d.log
        if isinstance(e, ev.RequestRestored | ev.RequestRequeued)
    ]
    assert recovered == [  # arrival order; the running one re-queued at once
        ("RequestRestored", "run"),
        ("RequestRequeued", "run"),
        ("RequestRestored", "j1"),
        ("RequestRestored", "j2"),
        ("RequestRestored", "j3"),
    ]
    assert queued(d.state) == ["j2", "run", "j1", "j3"]  # priority, then arrival
    assert d.state.requests["run"].attempt == 2 and d.state.running == {}
    assert "sync" not in d.state.requests
    assert d.serve_all() == ["j2", "run", "j1", "j3"]
    assert audit(enumerate(d.log, start=1)).violations == []


def test_equal_scores_keep_arrival_order_across_restarts_with_or_without_aging() -> None:
    # The job that was running arrived first: without aging it used to queue last
    # after a restart; with aging its original enqueue time already put it first.
    for params in (ScoringParams(0, 0), ScoringParams(MIN, 0)):
        d = CoreDriver(params, resident="A")
        d.enqueue("first", "A", durable=True)
        assert d.dispatch_all() == ["first"]
        for rid in ("second", "third"):
            d.enqueue(rid, "A", durable=True)  # same instant: equal scores even with aging
        d.restart()
        assert queued(d.state) == ["first", "second", "third"], params
        d.restart()  # and again, now that none runs
        assert d.serve_all() == ["first", "second", "third"], params


def test_restored_jobs_tie_in_the_order_they_were_restored() -> None:
    state = SchedulerState(ScoringParams(0, 0))  # no aging: enqueue times do not order
    apply(state, restored("late", T0, T0 + 5 * S))
    apply(state, restored("early", T0, T0))
    assert queued(state) == ["late", "early"]


def test_a_restored_job_ages_from_its_original_enqueue_time() -> None:
    # Restored at the restart's time, "old" (0) would lose to "new" (+5); with 11 minutes
    # of aging it wins.
    d = CoreDriver(ScoringParams(MIN, 0))
    d.enqueue("old", "A", 0, durable=True)
    d.advance(10 * MIN)
    d.enqueue("new", "A", 5, durable=True)
    d.advance(MIN)
    d.restart()
    restores = [e for e in d.log if isinstance(e, ev.RequestRestored)]
    assert [(e.request_id, e.enqueued_at) for e in restores] == [
        ("old", T0),
        ("new", T0 + 10 * MIN),
    ]
    assert d.serve_all() == ["old", "new"]


def test_server_started_gives_fifo_its_per_model_priorities() -> None:
    def first_dispatch(model_priority: dict[str, int]) -> str:
        d = CoreDriver(
            ScoringParams(0, 0), scheduler=FIFO, resident="A", model_priority=model_priority
        )
        d.enqueue("a", "A")
        d.enqueue("b", "B")
        step = d.step()
        assert step is not None
        return step.request_id

    assert first_dispatch({}) == "a"
    assert first_dispatch({"B": 10}) == "b"  # the log alone says B's requests go first


def test_server_started_gives_fifo_its_concurrency_limits() -> None:
    d = CoreDriver(ScoringParams(0, 0), scheduler=FIFO, resident="A", concurrency={"A": 2})
    for rid in ("a1", "a2", "a3"):
        d.enqueue(rid, "A")
    assert d.dispatch_all() == ["a1", "a2"]
    d.restart()  # a restart with the same settings: the limit still holds
    assert d.dispatch_all() == []  # nothing durable: nothing to put back
    assert d.state.concurrency == {"A": 2}


def test_a_log_written_before_restores_were_recorded_folds_as_that_recovery_did() -> None:
    # log_format 1: recovery put jobs back without an event; the fold does it instead.
    old, new = history(), history()
    old.restart(log_format=1)
    new.restart()
    assert not any(isinstance(e, ev.RequestRestored) for e in old.log)
    # The older recovery re-queued the running job after all the others, so on
    # ties it went last; the fold of that log still says so.
    assert queued(old.state) == ["j2", "j1", "j3", "run"]
    assert queued(new.state) == ["j2", "run", "j1", "j3"]
    assert snapshot(old.state)["requests"] == snapshot(new.state)["requests"]
    assert old.serve_all() == ["j2", "j1", "j3", "run"]


def test_db_check_flags_a_dispatch_of_a_job_the_restart_did_not_restore() -> None:
    d = CoreDriver(ScoringParams(0, 0), resident="A")
    d.enqueue("job", "A", durable=True)
    enqueued_log = list(d.log)
    dispatch = ev.RequestDispatched(at=T0, request_id="job", model="A")

    def check(*events: ev.AnyEvent) -> list[str]:
        found = audit(enumerate([*enqueued_log, *events], start=1)).violations
        return [v.message for v in found]

    def started(log_format: int) -> ev.ServerStarted:
        return ev.ServerStarted(
            at=T0,
            version="t",
            config_hash="",
            scheduler="serial",
            aging_divisor_ns=0,
            swap_affinity_bonus=0,
            log_format=log_format,
        )

    [message] = check(started(2), dispatch)
    assert "job" in message and "not restored" in message
    assert check(started(2), restored("job", T0, T0), dispatch) == []
    assert check(started(1), dispatch) == []  # older logs record no restores
    assert check(dispatch) == []
    [unknown] = check(restored("ghost", T0, T0))
    assert "ghost" in unknown and "no earlier request_enqueued" in unknown
