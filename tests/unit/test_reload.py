"""A config reload (SIGHUP, -watch-config): the core's plan (app/core/reload.py),
the fold that keeps the queue under new terms (`SchedulerState._reconfigure`),
and the run loop carrying it out against fakes (tests/unit/run_loop_fakes.py)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from app.config import parse_config
from app.core import events as ev
from app.core.policy import ahead_of
from app.core.reload import plan_reload
from app.core.state import SchedulerState, apply
from app.runtime.reload import process_identity, reload_summary
from tests.unit.core_driver import T0, CoreDriver
from tests.unit.run_loop_fakes import Lane, config_text, settle
from tools.replay.verify import verify


def cfg(models: dict[str, dict[str, Any]], **settings: Any) -> str:
    return config_text(models, **settings)


ABC = {"A": {}, "B": {}, "C": {}}


# -- the core's plan ----------------------------------------------------------------


def test_a_reload_fails_the_waiting_requests_of_removed_models_only() -> None:
    d = CoreDriver()
    d.enqueue("running-on-a", "a")
    d.dispatch_all()
    d.enqueue("waits-for-a", "a")
    d.enqueue("waits-for-b", "b")
    plan = plan_reload(d.state, {"a": 1, "b": 1}, {"b": 1, "c": 1}, ["a"])
    assert plan.removed == ["a"] and plan.added == ["c"]
    assert plan.failed == ["waits-for-a"]  # the running one finishes
    assert plan.restarted == ["a"]


def test_a_model_whose_process_changed_is_restarted_and_an_unchanged_one_is_not() -> None:
    d = CoreDriver()
    plan = plan_reload(
        d.state, {"a": ("cmd1",), "b": ("x",)}, {"a": ("cmd2",), "b": ("x",)}, ["a", "b"]
    )
    assert plan.restarted == ["a"] and plan.failed == [] and plan.removed == []


def test_the_reload_line_names_each_model_and_why_it_restarts() -> None:
    # z removed and e added keep every other model's port (given in id order).
    old = parse_config(cfg({"a": {}, "c": {}, "d": {}, "z": {}}))
    new = parse_config(
        cfg(
            {
                "a": {"cmd": "other-server --port ${PORT}", "env": ["X=1"]},
                "c": {},
                "d": {"checkEndpoint": "/ready"},
                "e": {},
            }
        )
    )
    processes = process_identity(old), process_identity(new)
    plan = plan_reload(CoreDriver().state, *processes, ["a", "z"])

    assert reload_summary(plan, *processes) == (
        "1 added (e), 1 removed (z), "
        "2 to restart once idle (a: cmd, env changed; z: removed), "
        "1 changed, not loaded (d: checkEndpoint changed)"
    )
    # Every key of the identity is named by its config key.
    for key, value in (("cmdStop", "kill ${PID}"), ("proxy", "http://127.0.0.1:${PORT}")):
        changed = process_identity(parse_config(cfg({"a": {key: value}})))
        plan = plan_reload(CoreDriver().state, processes[0], changed, ["a"])
        assert f"(a: {key} changed)" in reload_summary(plan, processes[0], changed)


# -- the fold -----------------------------------------------------------------------


def started(**kw: Any) -> ev.ServerStarted:
    fields: dict[str, Any] = {
        "at": T0,
        "version": "t",
        "config_hash": "h",
        "scheduler": "serial",
        "aging_divisor_ns": 10**9,
        "swap_affinity_bonus": 0,
        "log_format": ev.LOG_FORMAT,
    }
    return ev.ServerStarted(**(fields | kw))


def test_the_fold_keeps_the_queue_and_orders_it_by_the_new_terms() -> None:
    d = CoreDriver()
    d.apply(started())
    d.load("a")
    d.enqueue("running", "a")
    d.dispatch_all()
    d.enqueue("for-b", "b")
    d.advance(10**9)
    d.enqueue("for-a", "a")
    # Without affinity, for-b (first) goes next; a reload adds a bonus for the
    # resident model a, so for-a goes first from the next decision on.
    assert ahead_of(d.state, "for-b") == 0
    d.apply(
        ev.ConfigReloaded(at=d.now, config_hash="h2", parameters=started(swap_affinity_bonus=50))
    )
    assert set(d.state.requests) == {"running", "for-b", "for-a"}
    assert list(d.state.running) == ["running"]
    assert d.state.config_hash == "h2"
    assert ahead_of(d.state, "for-a") == 0
    d.complete("running")
    assert d.dispatch_all()[0] == "for-a"


def test_a_state_folded_with_a_reload_decides_as_one_started_with_its_parameters() -> None:
    """What a reload leaves equals a fresh start under the new parameters with the
    same requests queued in the same order: the reload loses nothing."""
    a, b = SchedulerState(), SchedulerState()
    apply(a, started(swap_affinity_bonus=0))
    apply(b, started(swap_affinity_bonus=7, fair_share_bonus=0))
    for state in (a, b):
        for n in range(5):
            apply(
                state,
                ev.RequestEnqueued(
                    at=T0 + n,
                    request_id=f"r{n}",
                    model="m",
                    model_requested="m",
                    endpoint="",
                    priority=n % 3 * 10,
                    band="normal",
                ),
            )
    apply(
        a, ev.ConfigReloaded(at=T0 + 9, config_hash="x", parameters=started(swap_affinity_bonus=7))
    )
    order = [q.request_id for q in sorted(a.queue, key=lambda q: q.order)]
    assert order == [q.request_id for q in sorted(b.queue, key=lambda q: q.order)]
    assert [a.score(q, T0 + 10).total for q in a.queue] == [
        b.score(q, T0 + 10).total for q in b.queue
    ]


# -- the run loop -------------------------------------------------------------------


async def test_a_reload_serves_added_models_and_keeps_the_queue() -> None:
    lane = Lane(cfg({"A": {}, "B": {}}))
    running = lane.admit("A")
    waiting = lane.admit("B")
    await settle()
    event = lane.scheduler.reload(parse_config(cfg({"A": {}, "B": {}, "C": {}})))
    assert event is not None and event.added == ["C"] and event.restarted == []
    assert "C" in lane.config.models  # the one live config is the new one
    assert waiting.request_id in lane.scheduler.state.requests
    await lane.finish(running)
    await lane.finish(waiting)
    added = lane.admit("C")
    await lane.finish(added)
    assert [e.request_id for e in lane.events(ev.RequestCompleted)] == [
        running.request_id,
        waiting.request_id,
        added.request_id,
    ]
    assert verify(lane.store.events).ok  # replay reproduces every decision across it


async def test_a_removed_model_fails_what_waits_and_finishes_what_runs() -> None:
    lane = Lane(
        cfg({"A": {}, "B": {}}, scheduler="fifo")
        if False
        else cfg({"A": {"concurrencyLimit": 1}, "B": {}})
    )
    running = lane.admit("A")
    await settle()
    waiting = lane.admit("A")
    await settle()
    lane.scheduler.reload(parse_config(cfg({"B": {}})))
    failed = lane.ended(waiting)
    assert isinstance(failed, ev.RequestFailed) and failed.http_status == 404
    assert "removed from the config" in failed.error
    assert waiting.detached.result().code == "model_not_found"
    await settle()
    assert lane.upstreams.calls == [("start", "A")]  # A is busy: not stopped mid-request
    await lane.finish(running)
    await settle()
    assert lane.upstreams.calls == [("start", "A"), ("stop", "A")]
    assert [e.reason for e in lane.events(ev.ProcessStopped)] == ["reload"]


async def test_a_changed_model_restarts_once_idle_and_never_mid_request() -> None:
    lane = Lane(cfg(ABC))
    first = lane.admit("A")
    await settle()
    changed = cfg({"A": {"env": ["NEW=1"]}, "B": {}, "C": {}})
    event = lane.scheduler.reload(parse_config(changed))
    assert event is not None and event.restarted == ["A"]
    await settle()
    assert lane.upstreams.calls == [("start", "A")]
    assert lane.events(ev.ProcessStopping) == []
    await lane.finish(first)
    await settle()
    assert lane.upstreams.calls == [("start", "A"), ("stop", "A")]
    second = lane.admit("A")
    await lane.finish(second)
    assert lane.upstreams.calls == [("start", "A"), ("stop", "A"), ("start", "A")]
    assert lane.upstreams.last("A").spec.env.get("NEW") == "1"


async def test_an_idle_changed_model_stops_at_once_and_an_unchanged_one_stays() -> None:
    lane = Lane(cfg(ABC))
    await lane.finish(lane.admit("A"))
    lane.scheduler.reload(parse_config(cfg({"A": {"ttl": 60}, "B": {}, "C": {}})))
    await settle()
    assert lane.upstreams.calls == [("start", "A")]  # a TTL is no part of its process
    lane.scheduler.reload(
        parse_config(cfg({"A": {"cmd": "other --port ${PORT}"}, "B": {}, "C": {}}))
    )
    await settle()
    assert lane.upstreams.calls == [("start", "A"), ("stop", "A")]


# Each part of a model's process identity, changed alone (app/core/reload.py:
# command, stop command, address, environment, readiness check).
PROCESS_CHANGES = {
    "cmd": {"cmd": "other-server --port ${PORT}"},
    "cmdStop": {"cmdStop": "stop-server --port ${PORT}"},
    "proxy": {"proxy": "http://127.0.0.2:${PORT}"},
    "env": {"env": ["NEW=1"]},
    "checkEndpoint": {"checkEndpoint": "/ready"},
}


@pytest.mark.parametrize("key", sorted(PROCESS_CHANGES))
async def test_a_model_whose_process_changed_in_one_key_is_restarted(key: str) -> None:
    lane = Lane(cfg(ABC))
    await lane.finish(lane.admit("A"))
    same = lane.scheduler.reload(parse_config(cfg(ABC)))
    assert same is not None and same.restarted == []  # a reload alone restarts nothing
    changed = parse_config(cfg({"A": PROCESS_CHANGES[key], "B": {}, "C": {}}))
    assert changed.models["A"] != lane.config.models["A"], key  # the change took
    event = lane.scheduler.reload(changed)
    assert event is not None and event.restarted == ["A"], key
    await settle()
    assert lane.upstreams.calls == [("start", "A"), ("stop", "A")]


async def test_a_model_whose_peer_changed_is_restarted() -> None:
    """The peer a model's entry reaches: no config file changes it alone (a peer's
    entries are named `<peer>/<model>`), so the new config is made by hand."""
    lane = Lane(cfg(ABC))
    await lane.finish(lane.admit("A"))
    new = parse_config(cfg(ABC))
    moved = msgspec.structs.replace(new.models["A"], peer="elsewhere")
    new = msgspec.structs.replace(new, models={**new.models, "A": moved})
    event = lane.scheduler.reload(new)
    assert event is not None and event.restarted == ["A"]
