"""What one caller may store with its durable jobs: bounded bytes.

A durable job is stored until it ends: its body (`job_bodies`), and in its
`request_enqueued` event and request row the headers replayed upstream and its
`Idempotency-Key` (indexed too). The count of a caller's queued jobs is bounded
(`maxQueuedPerCaller`); these bound their bytes:

- an `Idempotency-Key` has at most `MAX_IDEMPOTENCY_KEY_BYTES` (400);
- each header a durable job stores (name and value, as forwarded upstream:
  never cut, so the job sends what its caller sent) has at most
  `MAX_STORED_HEADER_BYTES` (431); a synchronous request's headers are only
  forwarded, under the HTTP server's own limits (app/web/limits.py);
- a caller's open durable jobs hold at most `jobs.maxStoredBytesPerCaller`
  (429), counted by `StoredBytes`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from app.jobs.errors import HeaderTooLarge, Invalid

MAX_IDEMPOTENCY_KEY_BYTES: Final = 255
"""Bytes of an `Idempotency-Key` (Stripe's limit; a UUID takes 36)."""

MAX_STORED_HEADER_BYTES: Final = 8192
"""Bytes of one header a durable job stores, name and value (nginx's default
buffer for one header line)."""


def check_key(key: str | None) -> None:
    """Invalid (400) for an `Idempotency-Key` over its limit."""
    if key is not None and len(key) > MAX_IDEMPOTENCY_KEY_BYTES:
        raise Invalid(
            f"Idempotency-Key has {len(key)} bytes; gpulane stores at most "
            f"{MAX_IDEMPOTENCY_KEY_BYTES} bytes of it (a UUID takes 36)",
            "idempotency_key_too_long",
            "Idempotency-Key",
        )


def check_headers(headers: Mapping[str, str]) -> None:
    """HeaderTooLarge (431) for the first stored header over its limit."""
    for name, value in headers.items():
        size = len(name) + len(value)
        if size > MAX_STORED_HEADER_BYTES:
            raise HeaderTooLarge(
                f"header {name} has {size} bytes (name and value); a durable job stores "
                f"every header it forwards upstream, each at most {MAX_STORED_HEADER_BYTES} "
                "bytes: shorten it, or send the request without Prefer: respond-async",
                "stored_header_too_large",
                name,
            )


def stored_size(job: Mapping[str, Any], key: str | None = None) -> int:
    """Bytes a job holds in the database: its body, its stored headers, its key."""
    body = job.get("body_bytes")
    if body is None:  # logs written before job_bodies kept it in the event (base64)
        body = len(job.get("body") or "")
    headers = sum(len(k) + len(v) for k, v in (job.get("headers") or {}).items())
    return int(body) + headers + len(key or "")


class StoredBytes:
    """Each caller's open durable jobs and the bytes they hold. A job is counted
    from its acceptance until `is_open` says it has ended (pruned lazily: when
    a caller nears its cap, and as its table grows), so nothing has to tell
    this table of every job's end."""

    def __init__(self, is_open: Callable[[str], bool]) -> None:
        self._is_open = is_open
        self._jobs: dict[str | None, dict[str, int]] = {}
        self._totals: dict[str | None, int] = {}
        self._pruned_at: dict[str | None, int] = {}
        """How many jobs a caller had after its last pruning."""

    def add(self, caller: str | None, request_id: str, size: int) -> None:
        """Count a job (again: its size is replaced)."""
        jobs = self._jobs.setdefault(caller, {})
        self._totals[caller] = self._totals.get(caller, 0) + size - jobs.get(request_id, 0)
        jobs[request_id] = size
        # Amortised O(1): a caller's table is pruned each time it doubles.
        if len(jobs) > 2 * self._pruned_at.get(caller, 0) + 64:
            self._prune(caller)

    def knows(self, request_id: str, caller: str | None) -> bool:
        return request_id in self._jobs.get(caller, {})

    def remove(self, caller: str | None, request_id: str) -> None:
        """Uncount a job that was not accepted after all."""
        size = self._jobs.get(caller, {}).pop(request_id, None)
        if size is not None:
            self._totals[caller] -= size

    def held(self, caller: str | None) -> int:
        """Bytes `caller`'s open jobs hold now."""
        self._prune(caller)
        return self._totals.get(caller, 0)

    def fits(self, caller: str | None, size: int, cap: int) -> bool:
        """Whether `size` more bytes keep `caller` within `cap`."""
        if self._totals.get(caller, 0) + size <= cap:
            return True
        return self.held(caller) + size <= cap

    def _prune(self, caller: str | None) -> None:
        jobs = self._jobs.get(caller)
        if not jobs:
            return
        for request_id in [r for r in jobs if not self._is_open(r)]:
            self._totals[caller] -= jobs.pop(request_id)
        self._pruned_at[caller] = len(jobs)
        if not jobs:
            del self._jobs[caller], self._totals[caller], self._pruned_at[caller]


def over_cap_message(caller: str | None, held: int, size: int, cap: int) -> str:
    who = "the anonymous caller" if caller is None else f"caller {caller!r}"
    return (
        f"{who}'s open durable jobs hold {held} bytes in the database (bodies, stored "
        f"headers, idempotency keys); this one's {size} more would pass "
        f"jobs.maxStoredBytesPerCaller ({cap} bytes). Send it again once some have ended"
    )
