"""`/metrics` with a router and slots (issue 23, item 5): slots in use per model,
loads by reason, model stops (evictions among them) by reason."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest

from app.runtime.metrics import Metrics
from tests.unit.run_loop_fakes import Lane, config_text, settle


def config() -> str:
    entries: dict[str, dict[str, Any]] = {"A": {"concurrencyLimit": 3}, "B": {}, "C": {}}
    groups = {
        "gpu0": {"swap": True, "exclusive": False, "members": ["A", "B"]},
        "gpu1": {"swap": True, "exclusive": False, "members": ["C"]},
    }
    return config_text(entries, router={"use": "group", "settings": {"groups": groups}})


async def test_slots_in_use_loads_and_evictions() -> None:
    lane = Lane(config())
    state = lane.scheduler.state
    metrics = Metrics(lambda: state, lane.clock)
    a1, a2 = lane.admit("A"), lane.admit("A")
    c1 = lane.admit("C")
    await settle()
    text = generate_latest(metrics.registry).decode()
    assert 'gpulane_model_slots_in_use{model="A"} 2.0' in text
    assert 'gpulane_model_slots{model="A"} 3.0' in text
    assert 'gpulane_model_slots_in_use{model="C"} 1.0' in text
    assert 'gpulane_model_slots_in_use{model="B"} 0.0' in text
    b1 = lane.admit("B")
    await lane.finish(a1)
    await lane.finish(a2)  # A drained: B's load evicts it
    await lane.finish(c1)
    await lane.finish(b1)
    for event in lane.events():
        metrics.observe(event, state)
    text = generate_latest(metrics.registry).decode()
    assert 'gpulane_loads_total{model="A",reason="request"} 1.0' in text
    assert 'gpulane_loads_total{model="B",reason="request"} 1.0' in text
    assert 'gpulane_loads_total{model="C",reason="request"} 1.0' in text
    assert 'gpulane_model_stops_total{model="A",reason="evicted"} 1.0' in text
    assert 'gpulane_model_slots_in_use{model="A"} 0.0' in text
