"""Logs written by the first version keep decoding: events only ever gain optional fields.

tests/fixtures/events_v1.jsonl is a log in the first version's format, written
by hand and never regenerated. If a test here fails after a change to
app/core/events.py, the change broke old logs; fix the change, not the fixture.
A new event type needs a line added (test_fixture_covers_every_event_type).
"""

from __future__ import annotations

import json
import typing
from pathlib import Path

import msgspec
import pytest

from app.core import events as ev
from app.core.scoring import Breakdown

FIXTURE = Path(__file__).parents[1] / "fixtures" / "events_v1.jsonl"
LINES = FIXTURE.read_text().splitlines()


def test_fixture_covers_every_event_type() -> None:
    tags = {json.loads(line)["type"] for line in LINES}
    assert tags == {cls.__struct_config__.tag for cls in typing.get_args(ev.AnyEvent)}


@pytest.mark.parametrize("line", LINES, ids=lambda line: json.loads(line)["type"])
def test_v1_line_decodes_and_round_trips(line: str) -> None:
    event = ev.decode(line)
    raw = json.loads(line)
    assert ev.type_name(event) == raw["type"]
    assert event.at == raw["at"]
    assert ev.decode(ev.encode(event)) == event
    # Every field written by v1 is still there with the same value (in an event
    # it carries too: a config_reloaded's parameters gain fields as server_started does).
    assert _written_by(raw, json.loads(ev.encode(event))) == raw


def _written_by(raw: dict[str, typing.Any], now: dict[str, typing.Any]) -> dict[str, typing.Any]:
    """`now` cut to the fields `raw` has, in nested events too."""
    return {
        k: _written_by(raw[k], v) if isinstance(v, dict) and "type" in v else v
        for k, v in now.items()
        if k in raw
    }


def test_v1_values_decode_to_the_expected_events() -> None:
    events = [ev.decode(line) for line in LINES]
    assert events[2] == ev.RequestEnqueued(
        at=1735689601500000000,
        request_id="job-1",
        model="llama3-8b",
        model_requested="llama3-8b",
        endpoint="/v1/completions",
        priority=-100,
        band="batch",
        durable=True,
        caller="nightly",
        idempotency_key="nightly-2025-01-01",
        job={
            "method": "POST",
            "path": "/v1/completions",
            "headers": {"content-type": "application/json"},
            "body": '{"prompt":"hi"}',
        },
    )
    assert events[3].winner == Breakdown(priority=100, affinity=0, aging=0.0166, total=100.0166)
    assert events[6] == ev.ProcessStarted(
        at=1735689602002000000,
        model="qwen2.5-7b",
        pid=5151,
        cmdline=["llama-server", "--port", "9001", "-m", "/models/qwen2.5-7b.gguf"],
        port=9001,
    )


def test_optional_fields_missing_from_old_lines_take_their_defaults() -> None:
    enqueued = ev.decode(LINES[15])
    assert isinstance(enqueued, ev.RequestEnqueued)
    assert (enqueued.durable, enqueued.attempt, enqueued.job, enqueued.caller) == (
        False,
        1,
        None,
        None,
    )
    assert ev.decode(LINES[29]) == ev.RecoveryFinished(at=1735689639000000000)
    assert ev.decode(LINES[31]) == ev.RequestRejected(
        at=1735689641000000000,
        request_id="req-11",
        endpoint="/v1/chat/completions",
        http_status=400,
        error="body is not JSON",
        model_requested=None,
        priority=0,
        band="normal",
    )
    dispatched = ev.decode(LINES[25])
    assert dispatched == ev.RequestDispatched(
        at=1735689635000000000, request_id="job-1", model="llama3-8b", attempt=1, swap=False
    )


def test_unknown_fields_from_a_newer_version_are_ignored() -> None:
    line = json.loads(LINES[8])
    line["added_later"] = {"anything": [1, 2]}
    assert ev.decode(json.dumps(line)) == ev.decode(LINES[8])


def test_a_changed_field_type_is_refused() -> None:
    line = json.loads(LINES[8])
    line["request_id"] = 17
    with pytest.raises(msgspec.ValidationError):
        ev.decode(json.dumps(line))


@pytest.mark.parametrize(
    ("index", "request_id", "model"),
    [
        (0, None, None),
        (1, "req-1", "qwen2.5-7b"),
        (3, "req-1", None),
        (5, "req-1", "qwen2.5-7b"),  # swap_started: the model being loaded
        (6, None, "qwen2.5-7b"),
        (18, "req-3", None),
    ],
)
def test_indexed_columns(index: int, request_id: str | None, model: str | None) -> None:
    event = ev.decode(LINES[index])
    assert (ev.request_id_of(event), ev.model_of(event)) == (request_id, model)
