"""Token counts and speed read from an upstream's response as it streams by.

OpenAI-style `usage` and llama.cpp `timings` may sit in a plain JSON body or
in the last SSE chunks; we keep only a bounded tail so a long stream costs
constant memory and the chunks themselves pass through untouched.
"""

from __future__ import annotations

import json
from typing import Any

_TAIL_BYTES = 64 * 1024


class UsageSniffer:
    def __init__(self) -> None:
        self._tail = bytearray()
        self.bytes = 0

    def feed(self, chunk: bytes) -> None:
        self.bytes += len(chunk)
        self._tail += chunk
        if len(self._tail) > _TAIL_BYTES:
            del self._tail[: len(self._tail) - _TAIL_BYTES]

    def result(self) -> tuple[int | None, int | None, float | None]:
        """(input tokens, output tokens, output tokens per second), None where unknown."""
        found: dict[str, Any] = {}
        for doc in self._documents():
            usage = doc.get("usage")
            if isinstance(usage, dict):
                found["in"] = usage.get("prompt_tokens", usage.get("input_tokens"))
                found["out"] = usage.get("completion_tokens", usage.get("output_tokens"))
            timings = doc.get("timings")
            if isinstance(timings, dict):
                found.setdefault("in", timings.get("prompt_n"))
                found.setdefault("out", timings.get("predicted_n"))
                found["tps"] = timings.get("predicted_per_second")
        return (_int(found.get("in")), _int(found.get("out")), _float(found.get("tps")))

    def _documents(self) -> list[dict[str, Any]]:
        text = bytes(self._tail).decode("utf-8", "replace")
        stripped = text.lstrip()
        if stripped.startswith("{"):
            return [d for d in [_loads(stripped)] if d is not None]
        docs = []
        for line in text.splitlines():
            if line.startswith("data:"):
                payload = line[5:].strip()
                if payload.startswith("{") and ('"usage"' in payload or '"timings"' in payload):
                    doc = _loads(payload)
                    if doc is not None:
                        docs.append(doc)
        return docs


def _loads(text: str) -> dict[str, Any] | None:
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _int(value: object) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _float(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
