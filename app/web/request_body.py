"""Reading and rewriting request bodies: the model name, filters, size limit."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from decimal import Decimal
from typing import Any, Final
from urllib.parse import parse_qs

from litestar.types import Receive


class BadRequest(Exception):
    """A request refused before it is queued; `param` names the field at fault."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


MAX_WAIT_HEADER = "x-gpulane-max-wait"
_MAX_WAIT_LIMIT_S = 366 * 86400
_PLAIN_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def max_wait_ns(headers: dict[str, str]) -> int | None:
    """`X-Gpulane-Max-Wait: SECONDS`: the longest the caller will wait in the queue
    (a plain decimal number > 0, at most a year); None when absent. 400 otherwise."""
    text = headers.get(MAX_WAIT_HEADER)
    if text is None:
        return None
    # Only plain ASCII digits with an optional fraction: Decimal() (like int() and
    # float()) would also take `1_0`, `1e1`, `+10`, `Infinity` and non-ASCII digits.
    plain = text.strip()
    seconds = Decimal(plain) if len(plain) <= 40 and _PLAIN_DECIMAL.fullmatch(plain) else None
    if seconds is None or not 0 < seconds <= _MAX_WAIT_LIMIT_S:
        raise BadRequest(
            400,
            f"X-Gpulane-Max-Wait: {plain[:40]!r} is not allowed; expected seconds "
            f"as a decimal number > 0 and at most {_MAX_WAIT_LIMIT_S} (a year), in plain "
            "digits with an optional fraction, such as 30 or 2.5",
            "invalid_max_wait",
        )
    return max(1, int(seconds * 1_000_000_000))


async def read_body(
    receive: Receive, limit: int, too_large: Callable[[], BadRequest] | None = None
) -> bytes:
    """The whole request body; as soon as it passes `limit` bytes, `too_large()`
    is raised (by default 413 naming server.maxBodyBytes). Gathered in one
    growing buffer that becomes the result without a copy, so a large body
    takes about its own size (a list of chunks joined took twice)."""
    buffer = io.BytesIO()
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionError("client disconnected while sending the body")
        chunk: bytes = message.get("body", b"")  # type: ignore[assignment]
        size += len(chunk)
        if size > limit:
            if too_large is not None:
                raise too_large()
            raise BadRequest(
                413,
                f"request body is larger than the limit of {limit} bytes (server.maxBodyBytes)",
                "request_too_large",
            )
        if not message.get("more_body", False):
            if not buffer.tell():
                return chunk  # all in one message, as most bodies are
            buffer.write(chunk)
            return buffer.getvalue()
        buffer.write(chunk)


MAX_JSON_DEPTH: Final = 128
"""The deepest nesting of arrays and objects a JSON body may have (docs/http.md):
ample for any OpenAI request (a tool's JSON schema nests a few dozen levels at
most), far below where parsing or re-encoding it would exhaust Python's stack."""

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_AS_SQUARE = bytes.maketrans(b"{}", b"[]")
_CHUNK = MAX_JSON_DEPTH


def check_json_depth(body: bytes) -> None:
    """400 when `body` nests arrays and objects deeper than MAX_JSON_DEPTH.

    Checked before parsing, without recursion, mostly at C speed: at once for a
    body with fewer opening brackets than the limit (most bodies); otherwise
    strings are cut out, the brackets kept, and a chunk that cannot pass the
    limit from the depth it starts at is counted whole, not byte by byte."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return
    brackets = _JSON_STRING.sub(b"", body).translate(_AS_SQUARE, _NOT_BRACKETS)
    depth = 0
    for start in range(0, len(brackets), _CHUNK):
        chunk = brackets[start : start + _CHUNK]
        opening = chunk.count(b"[")
        if depth + opening <= MAX_JSON_DEPTH:
            depth += 2 * opening - len(chunk)
            continue
        for byte in chunk:
            depth += 1 if byte == 0x5B else -1  # "[" (and "{", translated)
            if depth > MAX_JSON_DEPTH:
                raise BadRequest(
                    400,
                    f"request body nests arrays and objects deeper than {MAX_JSON_DEPTH} "
                    "levels, the limit gpulane accepts",
                    "json_too_deep",
                )


def _no_constant(name: str) -> Any:
    raise BadRequest(
        400,
        f"request body is not valid JSON: {name} is not a JSON number "
        "(NaN and Infinity are not allowed)",
        "invalid_json",
    )


def json_model(body: bytes) -> tuple[dict[str, Any], str]:
    """The parsed JSON body and its `model`: 400 for invalid JSON, NaN and
    Infinity included, and for nesting deeper than MAX_JSON_DEPTH."""
    check_json_depth(body)
    try:
        doc = json.loads(body, parse_constant=_no_constant)
    except ValueError as exc:
        raise BadRequest(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(doc, dict):
        raise BadRequest(400, "request body must be a JSON object", "invalid_json")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest(
            400, "request body has no 'model' (a string naming a model)", "missing_model", "model"
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
    raise BadRequest(400, "form has no 'model' field", "missing_model", "model")


def rename_form_model(body: bytes, content_type: str, model: str) -> bytes:
    """The body with its `model` field set to `model` (useModelName); other parts untouched."""
    sections = _form_sections(body, content_type)
    for i in _model_sections(sections):
        head = sections[i].partition(b"\r\n\r\n")[0]
        sections[i] = head + b"\r\n\r\n" + model.encode() + b"\r\n"
    return _form_delimiter(content_type).join(sections)


def _model_sections(sections: list[bytes]) -> list[int]:
    """The parts that are the `model` form field: a Content-Disposition naming
    exactly `model` and no file name. A file part is never the model, whatever
    its name or file name."""
    found = []
    for i, section in enumerate(sections[1:], start=1):
        head, sep, _ = section.partition(b"\r\n\r\n")
        if not sep:
            continue
        for line in head.split(b"\r\n"):
            name, colon, value = line.partition(b":")
            if colon and name.strip().lower() == b"content-disposition":
                params = _disposition_params(value.decode("latin-1"))
                if params.get("name") == "model" and not params.keys() & _FILE_NAMES:
                    found.append(i)
                break
    return found


_FILE_NAMES = {"filename", "filename*"}
_PARAM = re.compile(r';\s*([^\s=;]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)')


def _disposition_params(value: str) -> dict[str, str]:
    """`form-data; name="model"; filename="a.wav"` -> {"name": "model", "filename": "a.wav"}
    (names lowercased, quoted values unquoted; the first of a repeated name)."""
    params: dict[str, str] = {}
    for match in _PARAM.finditer(value):
        key, raw = match.group(1).lower(), match.group(2).strip()
        if raw.startswith('"'):
            raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
        params.setdefault(key, raw)
    return params


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


def query_model(query_string: bytes) -> str:
    """The `model` query parameter of a GET route (`/props?model=...`)."""
    values = parse_qs(query_string.decode("latin-1"), encoding="utf-8").get("model", [])
    model = values[0].strip() if values else ""
    if not model:
        raise BadRequest(
            400, "request has no 'model' query parameter (?model=NAME)", "missing_model"
        )
    return model


def rewrite(doc: dict[str, Any], spec: Any, requested: str | None = None) -> dict[str, Any] | None:
    """Apply useModelName and filters (stripParams, setParams, then the
    setParamsByID entry of the `requested` name, which wins, as in llama-swap);
    None when the body needs no change, so an untouched body passes through
    byte for byte."""
    changed = False
    if spec.use_model_name and doc.get("model") != spec.use_model_name:
        doc["model"] = spec.use_model_name
        changed = True
    for name in spec.strip_params:
        if name != "model" and name in doc:
            del doc[name]
            changed = True
    by_id = spec.set_params_by_id.get(requested, {}) if requested is not None else {}
    for name, value in {**spec.set_params, **by_id}.items():
        if name != "model" and (name not in doc or doc[name] != value):
            doc[name] = value
            changed = True
    return doc if changed else None
