"""Reading a Batch API input file: pure functions, no I/O.

Each line of the JSONL is one request, in OpenAI's shape:

    {"custom_id": "shot-017", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "A", "messages": [...]}}

A line that is not such a request fails the batch in validation, with an
error naming the line and what is wrong (OpenAI's `errors` list), so nothing
is silently dropped. A well-formed line whose model is not configured is
answered in the error file instead, and the rest of the batch runs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Final

import msgspec

BATCH_ENDPOINTS: Final = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/rerank",
    "/v1/images/generations",
    "/v1/audio/speech",
    "/v1/messages",
    "/v1/videos",
)
"""The JSON inference routes a batch may target (its `endpoint`)."""

MAX_ERRORS: Final = 100
"""Validation errors reported for one file; the count says if there were more."""

_WINDOW = re.compile(r"([1-9][0-9]{0,6})([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW_S: Final = 366 * 86400


class LineError(msgspec.Struct, frozen=True):
    """One thing wrong with the input file, in OpenAI's `errors.data` shape."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None


class Line(msgspec.Struct, frozen=True):
    """A well-formed line: its request, and its configured model (None: not configured)."""

    line: int
    custom_id: str
    model: str | None
    model_requested: str
    body: bytes
    """The request body as it is sent upstream (after the model's rewrites)."""


def completion_window_s(text: object) -> int | None:
    """Seconds of a `completion_window` such as "24h", "30m", "7d"; None if invalid."""
    if not isinstance(text, str):
        return None
    match = _WINDOW.fullmatch(text.strip())
    if match is None:
        return None
    seconds = int(match.group(1)) * _UNIT_S[match.group(2)]
    return seconds if seconds <= MAX_WINDOW_S else None


def read_lines(
    content: bytes,
    endpoint: str,
    resolve: Callable[[str], str | None],
    rewrite: Callable[[str, dict[str, Any]], bytes],
) -> tuple[list[Line], list[LineError]]:
    """The lines of `content`, or what is wrong with them (lines numbered from 1).
    `resolve` maps a requested model to a configured one (None: not configured);
    `rewrite` gives the body as the model's settings send it upstream."""
    lines: list[Line] = []
    errors: list[LineError] = []
    seen: dict[str, int] = {}
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], [LineError("invalid_file", f"the file is not UTF-8: {exc}")]
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue  # a blank line (a trailing newline) is no request
        problem = _check(raw, number, endpoint, seen)
        if isinstance(problem, LineError):
            errors.append(problem)
            continue
        custom_id, body = problem
        seen[custom_id] = number
        requested = body["model"]
        model = resolve(requested)
        data = rewrite(model, body) if model is not None else b""
        lines.append(Line(number, custom_id, model, requested, data))
    if not lines and not errors:
        errors.append(LineError("empty_file", "the input file has no request lines"))
    return lines, errors


def _check(
    raw: str, number: int, endpoint: str, seen: dict[str, int]
) -> LineError | tuple[str, dict[str, Any]]:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        return LineError("invalid_json_line", f"line {number} is not valid JSON: {exc}", number)
    if not isinstance(doc, dict):
        return LineError("invalid_request", f"line {number} is not a JSON object", number)
    custom_id = doc.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        message = f"line {number} has no custom_id (a non-empty string)"
        return LineError("missing_required_parameter", message, number, "custom_id")
    if custom_id in seen:
        message = (
            f"line {number}: custom_id {custom_id!r} is already used on line {seen[custom_id]}; "
            "each custom_id must be unique in the file"
        )
        return LineError("duplicate_custom_id", message, number, "custom_id")
    method = doc.get("method")
    if method != "POST":
        message = f"line {number}: method is {method!r}; only 'POST' is supported"
        return LineError("invalid_method", message, number, "method")
    url = doc.get("url")
    if url != endpoint:
        message = f"line {number}: url {url!r} is not the batch's endpoint {endpoint!r}"
        return LineError("mismatched_endpoint", message, number, "url")
    body = doc.get("body")
    if not isinstance(body, dict):
        message = f"line {number}: body is missing or not a JSON object"
        return LineError("invalid_request", message, number, "body")
    if not isinstance(body.get("model"), str) or not body["model"]:
        message = f"line {number}: body.model is missing or not a string"
        return LineError("missing_required_parameter", message, number, "body.model")
    if body.get("stream") is True:
        message = f"line {number}: body.stream is true; a batch's answers are stored, not streamed"
        return LineError("invalid_request", message, number, "body.stream")
    return custom_id, body
