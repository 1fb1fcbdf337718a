"""The Responses API's `background: true` on durable jobs (issue 25, item 4),
through `gpulane serve` as a user starts it, driven with the official `openai`
client against the fake upstream's /v1/responses."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import openai
import pytest

from tests.e2e.gateway import Gateway, fake_model, poll

Start = Callable[[str], Gateway]
ALICE, BOB = "sk-alice-5d20", "sk-bob-9a41"


def config(extra: str = "") -> str:
    models = fake_model("A").replace("\n", "\n  ")
    return f"{extra}models:{models}\n"


def client(gw: Gateway, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)


def create(oa: openai.OpenAI, text: str, **fake: Any) -> Any:
    return oa.responses.create(
        model="A", input=text, background=True, extra_body={"fake": fake} if fake else None
    )


def wait(oa: openai.OpenAI, response_id: str, *want: str, timeout: float = 30) -> Any:
    return poll(
        lambda: (r := oa.responses.retrieve(response_id)).status in want and r,
        f"response {response_id} to be {' or '.join(want)}",
        timeout=timeout,
    )


def test_a_background_response_is_queued_then_polled_to_its_upstreams_output(
    gateway: Start,
) -> None:
    gw = gateway(config())
    oa = client(gw)
    # The first runs until the second is sent, so the second waits (a fixed run
    # could end first on a slow host).
    release = gw.tmp / "release"
    first = create(oa, "the first", hold_file=str(release), reply="one")
    try:
        assert first.status in ("queued", "in_progress") and first.id.startswith("resp_")
        assert first.background is True and first.output == []
        second = create(oa, "the second", reply="two")
        assert second.status == "queued"
    finally:
        release.touch()
    done = wait(oa, second.id, "completed")
    assert done.id == second.id and done.output_text == "two"
    assert done.usage is not None and done.usage.output_tokens == 1
    assert wait(oa, first.id, "completed").output_text == "one"
    # One mechanism: it is a durable job, sent upstream without `background`.
    job_id = second.id.removeprefix("resp_")
    [row] = gw.sql("SELECT durable, status, job FROM requests WHERE id = ?", job_id)
    assert row["durable"] and row["status"] == "completed"
    assert json.loads(row["job"])["door"] == "background"
    with gw.client() as http:
        assert http.get(f"/v1/jobs/{job_id}").json()["result"]["body"]["background"] is False
    # Without `background`, /v1/responses is proxied as before.
    plain = oa.responses.create(model="A", input="now", extra_body={"fake": {"reply": "sync"}})
    assert plain.status == "completed" and plain.output_text == "sync"
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve("resp_" + "0" * 32)


def test_cancel_withdraws_a_queued_response(gateway: Start) -> None:
    gw = gateway(config())
    oa = client(gw)
    # Runs until the queued one was cancelled: a fixed run could end first on a
    # slow host, and the other start.
    release = gw.tmp / "release"
    running = create(oa, "long", hold_file=str(release))
    try:
        queued = create(oa, "waits")
        cancelled = oa.responses.cancel(queued.id)
        assert cancelled.status == "cancelled"
        assert oa.responses.retrieve(queued.id).status == "cancelled"
        assert oa.responses.cancel(queued.id).status == "cancelled"  # twice is harmless
    finally:
        release.touch()
    assert wait(oa, running.id, "completed").status == "completed"
    failing = create(oa, "bad", status=500)
    ended = wait(oa, failing.id, "failed")
    assert ended.error is not None and "500" in ended.error.message


def test_a_queued_response_survives_sigkill_and_restart(gateway: Start) -> None:
    gw = gateway(config())
    oa = client(gw)
    running = create(oa, "long", delay=1.5, reply="again")
    queued = [create(oa, f"q{i}", reply=f"r{i}") for i in range(3)]
    assert {r.status for r in queued} == {"queued"}
    gw.kill()
    gw.start()
    for i, r in enumerate(queued):
        assert wait(oa, r.id, "completed", timeout=60).output_text == f"r{i}"
    assert wait(oa, running.id, "completed", timeout=60).output_text == "again"
    check = gw.db_check()
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_user_key_sees_only_its_own_background_responses(gateway: Start) -> None:
    keys = f"apiKeys:\n  - key: {ALICE}\n    label: alice\n  - key: {BOB}\n    label: bob\n"
    gw = gateway(config(keys))
    alice, bob = client(gw, ALICE), client(gw, BOB)
    mine = create(alice, "mine", reply="private")
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.cancel(mine.id)
    assert wait(alice, mine.id, "completed").output_text == "private"
