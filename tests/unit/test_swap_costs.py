"""Each model's current cost of each swap action, from the log (`app.core.swap_costs`)."""

from __future__ import annotations

from app.core import events as ev
from app.core.swap_costs import WINDOW, ActionCosts, slept_instead, swap_costs, woke

S = 1_000_000_000


def cold_start(model: str, at: int, took: int, pid: int = 1) -> list[ev.AnyEvent]:
    return [
        ev.ProcessStarted(at=at, model=model, pid=pid, cmdline=["x"]),
        # The swap's own duration also counts the wait for the evicted stops: not a start.
        ev.SwapFinished(at=at + took, model=model, duration_ms=(took + 5 * S) / 1e6),
    ]


def test_each_action_is_the_median_of_its_recent_ones() -> None:
    log: list[ev.AnyEvent] = []
    for i, took in enumerate((20, 22, 19)):
        log += cold_start("flux", i * 100 * S, took * S, pid=i)
    log += [
        ev.ProcessSlept(at=400 * S, model="flux", pid=2, duration_ms=500.0),
        ev.ProcessWoken(at=410 * S, model="flux", pid=2, duration_ms=1000.0),
        ev.ProcessWoken(at=420 * S, model="flux", pid=2, duration_ms=1400.0),
        ev.ProcessWoken(at=430 * S, model="flux", pid=2, duration_ms=900.0),
        ev.ProcessStopping(at=500 * S, model="flux", pid=2, reason="ttl"),
        ev.ProcessStopped(at=502 * S, model="flux", pid=2, reason="ttl", duration_ms=2000.0),
    ]
    costs = swap_costs(log).costs("flux")
    assert costs == ActionCosts(start_ns=20 * S, stop_ns=2 * S, sleep_ns=S // 2, wake_ns=S)
    assert costs.swap_in_ns(asleep=True) == S and costs.swap_in_ns(asleep=False) == 20 * S
    assert costs.swap_out_ns(sleeps=True) == S // 2 and costs.swap_out_ns(sleeps=False) == 2 * S


def test_a_wake_is_not_a_cold_start_and_a_failed_load_teaches_nothing() -> None:
    log: list[ev.AnyEvent] = [
        ev.ProcessWoken(at=S, model="qwen", pid=3, duration_ms=1200.0),
        ev.SwapFinished(at=S, model="qwen", duration_ms=1300.0),
        ev.ProcessStarted(at=2 * S, model="qwen", pid=4, cmdline=["x"]),
        ev.SwapFailed(at=9 * S, model="qwen", error="exited"),
    ]
    assert swap_costs(log).costs("qwen") == ActionCosts(wake_ns=1_200_000_000)


def test_an_old_log_stop_is_timed_between_its_two_events_and_a_crash_is_not_a_stop() -> None:
    log: list[ev.AnyEvent] = [
        ev.ProcessStopping(at=10 * S, model="a", pid=7, reason="evicted"),
        ev.ProcessStopped(at=13 * S, model="a", pid=7, reason="evicted"),
        ev.ProcessStopped(at=20 * S, model="b", pid=8, reason="crashed"),
    ]
    costs = swap_costs(log)
    assert costs.costs("a").stop_ns == 3 * S and costs.costs("b") == ActionCosts()


def test_the_window_follows_a_change() -> None:
    log: list[ev.AnyEvent] = []
    for i in range(WINDOW):
        log += cold_start("m", i * 100 * S, 60 * S, pid=i)
    for i in range(WINDOW // 2 + 1):
        log += cold_start("m", (WINDOW + i) * 100 * S, 10 * S, pid=100 + i)
    costs = swap_costs(log)
    assert costs.costs("m").start_ns == 10 * S and costs.count("m", "start") == WINDOW


def test_sentences() -> None:
    assert woke("qwen", 1_200_000_000) == "woke qwen in 1.2 s"
    flux = ActionCosts(start_ns=48 * S)
    assert (
        slept_instead("flux", flux)
        == "a cold start of flux costs 48 s: it was put to sleep instead"
    )
    assert slept_instead("x", ActionCosts()) == "x was put to sleep instead of stopped"
