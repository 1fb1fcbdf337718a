"""Reading and rewriting request bodies: the model name, filters, size limit."""

from __future__ import annotations

import json
from decimal import Decimal, InvalidOperation
from typing import Any

from litestar.types import Receive


class BadRequest(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


MAX_WAIT_HEADER = "x-gpulane-max-wait"
_MAX_WAIT_LIMIT_S = 366 * 86400


def max_wait_ns(headers: dict[str, str]) -> int | None:
    """`X-Gpulane-Max-Wait: SECONDS`: the longest the caller will wait in the queue
    (a decimal number > 0, at most a year); None when absent. 400 otherwise."""
    text = headers.get(MAX_WAIT_HEADER)
    if text is None:
        return None
    try:
        seconds = Decimal(text.strip())
    except InvalidOperation:
        seconds = Decimal("NaN")
    if not seconds.is_finite() or not 0 < seconds <= _MAX_WAIT_LIMIT_S:
        raise BadRequest(
            400,
            f"X-Gpulane-Max-Wait: {text.strip()[:40]!r} is not allowed; expected seconds "
            f"as a decimal number > 0 and at most {_MAX_WAIT_LIMIT_S} (a year)",
            "invalid_max_wait",
        )
    return max(1, int(seconds * 1_000_000_000))


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body; 413 as soon as it passes `limit` bytes."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionError("client disconnected while sending the body")
        chunk: bytes = message.get("body", b"")  # type: ignore[assignment]
        size += len(chunk)
        if size > limit:
            raise BadRequest(
                413,
                f"request body is larger than the limit of {limit} bytes (server.maxBodyBytes)",
                "request_too_large",
            )
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def json_model(body: bytes) -> tuple[dict[str, Any], str]:
    """The parsed JSON body and its `model`."""
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise BadRequest(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(doc, dict):
        raise BadRequest(400, "request body must be a JSON object", "invalid_json")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest(
            400, "request body has no 'model' (a string naming a model)", "missing_model"
        )
    return doc, model


def form_model(body: bytes, content_type: str) -> str:
    """The `model` field of a multipart/form-data body."""
    sections = _form_sections(body, content_type)
    for i in _model_sections(sections):
        model = sections[i].partition(b"\r\n\r\n")[2].rsplit(b"\r\n", 1)[0]
        text = model.decode("utf-8", "replace").strip()
        if text:
            return text
    raise BadRequest(400, "form has no 'model' field", "missing_model")


def rename_form_model(body: bytes, content_type: str, model: str) -> bytes:
    """The body with its `model` field set to `model` (useModelName); other parts untouched."""
    sections = _form_sections(body, content_type)
    for i in _model_sections(sections):
        head = sections[i].partition(b"\r\n\r\n")[0]
        sections[i] = head + b"\r\n\r\n" + model.encode() + b"\r\n"
    return _form_delimiter(content_type).join(sections)


def _model_sections(sections: list[bytes]) -> list[int]:
    found = []
    for i, section in enumerate(sections[1:], start=1):
        head, sep, _ = section.partition(b"\r\n\r\n")
        if sep and b'name="model"' in head.lower():
            found.append(i)
    return found


def _form_sections(body: bytes, content_type: str) -> list[bytes]:
    return body.split(_form_delimiter(content_type))


def _form_delimiter(content_type: str) -> bytes:
    boundary: str | None = None
    for part in content_type.split(";"):
        key, _, value = part.strip().partition("=")
        if key.lower() == "boundary":
            boundary = value.strip('"')
    if not content_type.lower().startswith("multipart/form-data") or not boundary:
        raise BadRequest(
            400, "expected a multipart/form-data body with a 'model' field", "invalid_form"
        )
    return b"--" + boundary.encode()


def rewrite(doc: dict[str, Any], spec: Any) -> dict[str, Any] | None:
    """Apply useModelName and filters; None when the body needs no change,
    so an untouched body passes through byte for byte."""
    changed = False
    if spec.use_model_name and doc.get("model") != spec.use_model_name:
        doc["model"] = spec.use_model_name
        changed = True
    for name in spec.strip_params:
        if name != "model" and name in doc:
            del doc[name]
            changed = True
    for name, value in spec.set_params.items():
        if name != "model" and doc.get(name) != value:
            doc[name] = value
            changed = True
    return doc if changed else None
