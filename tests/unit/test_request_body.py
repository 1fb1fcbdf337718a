"""Multipart bodies: finding the model, and useModelName renaming only that field."""

from __future__ import annotations

import httpx
import pytest

from app.web.request_body import BadRequest, form_model, rename_form_model

AUDIO = bytes(range(256)) * 4  # binary, with \r\n inside


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
