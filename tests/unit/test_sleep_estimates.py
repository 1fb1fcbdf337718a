"""A waiting request whose model sleeps expects a wake, not a cold load (issue 43):
the fold knows who sleeps, the estimates learn wakes apart from loads."""

from __future__ import annotations

from app.core import events as ev
from app.core.run_estimate import RunEstimates
from app.core.state import SchedulerState, apply

S = 1_000_000_000


def test_the_fold_knows_who_sleeps_and_which_load_is_a_wake() -> None:
    state = SchedulerState()
    apply(state, ev.ProcessSlept(at=1, model="a", pid=5, duration_ms=500.0))
    assert state.asleep == {"a"}
    apply(state, ev.ProcessWoken(at=2, model="a", pid=5, duration_ms=1000.0))
    assert state.asleep == frozenset() and state.waking == {"a"}
    apply(state, ev.SwapFinished(at=3, model="a", duration_ms=1000.0))
    assert state.waking == frozenset()
    apply(state, ev.ProcessSlept(at=4, model="a", pid=5, duration_ms=500.0))
    apply(state, ev.ProcessStopped(at=5, model="a", pid=5, reason="ttl"))
    assert state.asleep == frozenset()


def test_a_sleeping_models_load_is_its_wake() -> None:
    estimates = RunEstimates()
    estimates.observe_load("a", 20 * S)
    estimates.observe_load("a", S, woke=True)
    assert estimates.durations().load("a") == 20 * S
    assert estimates.durations(frozenset({"a"})).load("a") == S
    # Asleep but never woken yet: its load is all that is known.
    assert estimates.durations(frozenset({"b"})).load("b") == 20 * S
