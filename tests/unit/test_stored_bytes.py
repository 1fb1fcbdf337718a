"""The bytes each caller's open durable jobs hold (app/jobs/stored_bytes.py)."""

from __future__ import annotations

import pytest

from app.jobs.errors import HeaderTooLarge, Invalid
from app.jobs.stored_bytes import (
    MAX_IDEMPOTENCY_KEY_BYTES,
    MAX_STORED_HEADER_BYTES,
    StoredBytes,
    check_headers,
    check_key,
    stored_size,
)


def test_a_job_counts_until_it_ends_and_only_against_its_caller() -> None:
    open_jobs = {"a1", "a2", "b1"}
    table = StoredBytes(lambda rid: rid in open_jobs)
    table.add("alice", "a1", 600)
    table.add("alice", "a2", 300)
    table.add("bob", "b1", 900)
    table.add("alice", "a2", 300)  # counted again (a recovered job): not twice
    assert table.held("alice") == 900 and table.held("bob") == 900
    assert table.fits("alice", 100, 1000) and not table.fits("alice", 101, 1000)
    open_jobs.discard("a1")  # ended: what it held is free at the next look
    assert table.fits("alice", 700, 1000) and table.held("alice") == 300
    table.remove("alice", "a2")  # not accepted after all
    assert table.held("alice") == 0 and table.held(None) == 0


def test_ended_jobs_are_forgotten_as_the_table_grows() -> None:
    table = StoredBytes(lambda rid: False)  # every job has ended
    for i in range(10_000):
        table.add(None, f"r{i}", 10)
    assert len(table._jobs.get(None, {})) <= 64


def test_the_size_is_body_headers_and_key_and_the_limits_name_themselves() -> None:
    job = {"body_bytes": 1000, "headers": {"x-a": "12345"}}
    assert stored_size(job, "key") == 1000 + 8 + 3
    assert stored_size({"body": "QUJD", "headers": {}}) == 4  # an old log's base64 body
    check_key("k" * MAX_IDEMPOTENCY_KEY_BYTES)
    with pytest.raises(Invalid, match=f"at most {MAX_IDEMPOTENCY_KEY_BYTES} bytes") as caught:
        check_key("k" * (MAX_IDEMPOTENCY_KEY_BYTES + 1))
    assert caught.value.param == "Idempotency-Key"
    check_headers({"x-a": "v" * (MAX_STORED_HEADER_BYTES - 3)})
    with pytest.raises(HeaderTooLarge, match="header x-a has 8193 bytes") as too_large:
        check_headers({"x-a": "v" * (MAX_STORED_HEADER_BYTES - 2)})
    assert too_large.value.param == "x-a"
