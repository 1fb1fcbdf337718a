"""Reading a Batch API input file (app/jobs/batch_input.py) and a batch's default priority."""

from __future__ import annotations

import json
from typing import Any

from app.jobs.batch_input import completion_window_s, read_lines
from app.jobs.batches import batch_default

ENDPOINT = "/v1/chat/completions"


def resolve(name: str) -> str | None:
    return {"A": "A", "alias-a": "A"}.get(name)


def encode(model: str, doc: dict[str, Any]) -> bytes:
    return json.dumps(doc | {"model": model}).encode()


def request(custom_id: str, model: str = "A", **extra: Any) -> str:
    doc = {"custom_id": custom_id, "method": "POST", "url": ENDPOINT, "body": {"model": model}}
    return json.dumps(doc | extra)


def read(*lines: str) -> tuple[list[Any], list[Any]]:
    return read_lines("\n".join(lines).encode(), ENDPOINT, resolve, encode)


def test_good_lines_resolve_their_model_and_keep_their_numbers() -> None:
    lines, errors = read(request("a"), "", request("b", "alias-a"), request("c", "nope"))
    assert errors == []
    assert [(x.line, x.custom_id, x.model) for x in lines] == [
        (1, "a", "A"),
        (3, "b", "A"),
        (4, "c", None),
    ]
    assert json.loads(lines[1].body) == {"model": "A"}  # as the model's settings send it


def test_every_bad_line_is_named_with_what_is_wrong() -> None:
    _, errors = read(
        request("a"),
        "[1, 2",
        "[]",
        json.dumps({"method": "POST", "url": ENDPOINT, "body": {"model": "A"}}),
        request("a"),
        request("d", method="GET"),
        request("e", url="/v1/embeddings"),
        request("f", body=[1]),
        request("g", body={"messages": []}),
        request("h", body={"model": "A", "stream": True}),
    )
    assert [(e.line, e.code, e.param) for e in errors] == [
        (2, "invalid_json_line", None),
        (3, "invalid_request", None),
        (4, "missing_required_parameter", "custom_id"),
        (5, "duplicate_custom_id", "custom_id"),
        (6, "invalid_method", "method"),
        (7, "mismatched_endpoint", "url"),
        (8, "invalid_request", "body"),
        (9, "missing_required_parameter", "body.model"),
        (10, "invalid_request", "body.stream"),
    ]
    assert all(e.message.startswith(f"line {e.line}") for e in errors)
    assert "line 1" in errors[3].message  # where the custom_id was first used


def test_an_empty_or_undecodable_file_is_an_error() -> None:
    assert [e.code for e in read("", "  ")[1]] == ["empty_file"]
    lines, errors = read_lines(b"\xff\xfe", ENDPOINT, resolve, encode)
    assert lines == [] and [e.code for e in errors] == ["invalid_file"]


def test_completion_window() -> None:
    assert completion_window_s("24h") == 86400
    assert completion_window_s(" 30m ") == 1800
    assert completion_window_s("7d") == 7 * 86400
    for bad in ("", "24", "0h", "1.5h", "-1h", "1w", "367d", 24, None):
        assert completion_window_s(bad) is None, bad


def test_a_batch_queues_in_the_batch_band_keeping_the_keys_tier_offset() -> None:
    assert batch_default(0) == -100
    assert batch_default(2) == -98  # a key at normal+2
    assert batch_default(101) == -99  # interactive+1
    assert batch_default(-100) == -100
    assert batch_default(-150) == -150  # lower than batch: kept
