"""Request bodies: read whole up to a limit, the model of a multipart form
(useModelName renaming only that field), and JSON bodies a parser must not
choke on (deep nesting, NaN)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from app.web.request_body import (
    MAX_JSON_DEPTH,
    BadRequest,
    check_json_depth,
    form_model,
    json_model,
    max_wait_ns,
    read_body,
    rename_form_model,
)

AUDIO = bytes(range(256)) * 4  # binary, with \r\n inside


def chunked(*chunks: bytes) -> Any:
    """An ASGI `receive` that sends `chunks` as one body, in that many messages."""
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    return receive


def test_a_body_in_many_messages_is_read_whole_up_to_its_limit() -> None:
    assert asyncio.run(read_body(chunked(b"ab", b"", b"cd"), 4)) == b"abcd"
    with pytest.raises(BadRequest) as default:
        asyncio.run(read_body(chunked(b"ab", b"cd", b"e"), 4))
    assert default.value.status == 413 and "server.maxBodyBytes" in default.value.message

    def file_too_large() -> BadRequest:
        return BadRequest(413, "over jobs.maxFileBytes", "file_too_large")

    # The files route's own refusal, raised once the limit is passed, mid-body.
    with pytest.raises(BadRequest) as own:
        asyncio.run(read_body(chunked(b"abc", b"de", b"never read"), 4, file_too_large))
    assert own.value.code == "file_too_large"


def multipart(model: str) -> tuple[bytes, str]:
    request = httpx.Request(
        "POST",
        "http://x/v1/audio/transcriptions",
        data={"model": model, "language": "en"},
        files={"file": ("a.wav", AUDIO, "audio/wav")},
    )
    return request.read(), request.headers["content-type"]


def test_the_model_field_is_found_among_binary_parts() -> None:
    body, content_type = multipart("whisper-small")
    assert form_model(body, content_type) == "whisper-small"


def test_use_model_name_renames_the_field_and_leaves_the_rest_byte_for_byte() -> None:
    body, content_type = multipart("whisper")
    renamed = rename_form_model(body, content_type, "openai/whisper-large-v3")
    assert form_model(renamed, content_type) == "openai/whisper-large-v3"
    assert AUDIO in renamed and b'name="language"\r\n\r\nen\r\n' in renamed
    assert renamed.replace(b"openai/whisper-large-v3", b"whisper") == body


def test_a_form_without_model_or_boundary_is_a_clear_400() -> None:
    body, content_type = multipart("x")
    with pytest.raises(BadRequest, match="multipart/form-data"):
        form_model(body, "application/json")
    with pytest.raises(BadRequest, match="no 'model' field"):
        form_model(body.replace(b'name="model"', b'name="other"'), content_type)


def raw_form(*parts: tuple[str, bytes]) -> tuple[bytes, str]:
    """A multipart body from (Content-Disposition parameters, content) pairs."""
    boundary = "b0undary"
    body = b""
    for disposition, content in parts:
        body += f"--{boundary}\r\nContent-Disposition: form-data; {disposition}\r\n".encode()
        body += b"Content-Type: application/octet-stream\r\n" if "filename" in disposition else b""
        body += b"\r\n" + content + b"\r\n"
    body += f"--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


def test_a_file_part_is_never_the_model_field_nor_rewritten() -> None:
    # A file whose file name is "model" comes first: its bytes must not choose the model.
    body, content_type = raw_form(
        ('name="file"; filename="model"', b"RIFF-audio-bytes"),
        ('name="model"', b"whisper"),
    )
    assert form_model(body, content_type) == "whisper"
    renamed = rename_form_model(body, content_type, "org/whisper-large")
    assert b"RIFF-audio-bytes" in renamed
    assert renamed == body.replace(b"\r\n\r\nwhisper\r\n", b"\r\n\r\norg/whisper-large\r\n")


def test_only_a_form_field_named_exactly_model_is_the_model() -> None:
    # A file part named "model" is a file, not the field.
    body, content_type = raw_form(('name="model"; filename="a.wav"', b"RIFF-audio-bytes"))
    with pytest.raises(BadRequest, match="no 'model' field"):
        form_model(body, content_type)
    assert rename_form_model(body, content_type, "x") == body
    for other in ('name="model_id"', 'name="Model"', 'name="x"; note="name=\\"model\\""'):
        body, content_type = raw_form((other, b"whisper"))
        with pytest.raises(BadRequest, match="no 'model' field"):
            form_model(body, content_type)
    # An unquoted name (a token) is still the field.
    body, content_type = raw_form(("name=model", b"whisper"))
    assert form_model(body, content_type) == "whisper"


def nested(depth: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return b'{"model": "m", "x": ' + open_ * (depth - 1) + close * (depth - 1) + b"}"


def test_json_nested_deeper_than_the_limit_is_a_400_naming_it() -> None:
    # 1000 deep once gave a RecursionError (a 500 and a traceback).
    for body in (nested(1000), nested(MAX_JSON_DEPTH + 1), nested(400, b'{"a":', b"}")):
        with pytest.raises(BadRequest, match=f"deeper than {MAX_JSON_DEPTH}") as raised:
            json_model(body)
        assert (raised.value.status, raised.value.code) == (400, "json_too_deep")
    # Unclosed brackets are as deep for the parser.
    with pytest.raises(BadRequest, match="deeper than"):
        check_json_depth(b"[" * 5000)
    doc, model = json_model(nested(MAX_JSON_DEPTH))  # the limit itself is fine
    assert model == "m"


def test_brackets_in_strings_and_many_shallow_ones_are_not_depth() -> None:
    brackets = "[" * 5000 + '\\"{' * 300
    assert json_model(json.dumps({"model": "m", "prompt": brackets}).encode())[1] == "m"
    wide = {"model": "m", "messages": [{"role": "user", "content": [1]} for _ in range(5000)]}
    assert json_model(json.dumps(wide).encode())[1] == "m"
    # Depth counts on the way back up too: many levels, never too many at once.
    zigzag = b'{"model": "m", "x": [' + (b"[" * 100 + b"]" * 100 + b",") * 50 + b"1]}"
    assert json_model(zigzag)[1] == "m"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json(constant: str) -> None:
    with pytest.raises(BadRequest, match=f"{constant} is not a JSON number") as raised:
        json_model(b'{"model": "m", "temperature": ' + constant.encode() + b"}")
    assert (raised.value.status, raised.value.code) == (400, "invalid_json")


@pytest.mark.parametrize(
    "value", ["1_0", "1e1", "+10", "10.", ".5", "0x10", "١٠", "Infinity", "NaN", "0", "0.0", ""]
)
def test_max_wait_is_plain_decimal_seconds_only(value: str) -> None:
    # Python's int()/float()/Decimal() take underscores, exponents and non-ASCII digits.
    with pytest.raises(BadRequest, match="X-Gpulane-Max-Wait") as raised:
        max_wait_ns({"x-gpulane-max-wait": value})
    assert "decimal number" in raised.value.message
    assert (raised.value.status, raised.value.code) == (400, "invalid_max_wait")


def test_max_wait_reads_seconds_with_a_fraction() -> None:
    assert max_wait_ns({}) is None
    assert max_wait_ns({"x-gpulane-max-wait": " 10 "}) == 10 * 10**9
    assert max_wait_ns({"x-gpulane-max-wait": "0.25"}) == 250_000_000
    assert max_wait_ns({"x-gpulane-max-wait": "007.5"}) == 7_500_000_000
