"""Error answers of a running `gpulane serve` in OpenAI's own shape.

Clients generated from OpenAI's OpenAPI spec read an error as its
`ErrorResponse`, whose `Error` requires `param` (null where no field is at
fault). The schema is vendored in tests/fixtures/openai/ (the file names the
commit of openai/openai-openapi it came from); every answer here is checked
against it as a client would read it.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from app.web.errors import error_body
from app.web.forward import sse_error
from tests.e2e.gateway import Gateway, fake_model, poll

SCHEMA = json.loads(
    (Path(__file__).parents[1] / "fixtures" / "openai" / "error_response.schema.json").read_text()
)
USER, ADMIN = "sk-user-4f1a", "sk-admin-9b2e"

CONFIG = f"""\
maxQueuedPerCaller: 1
apiKeys:
  - {{key: {USER}, label: u, role: user}}
  - {ADMIN}
models:{fake_model("m").replace(chr(10), chr(10) + "  ")}
"""


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(model: str = "m", **fake: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "fake": fake}


def openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    """The answer's error object, once its body validates as OpenAI's ErrorResponse."""
    assert r.status_code == status, r.text
    body = r.json()
    jsonschema.Draft202012Validator(SCHEMA).validate(body)
    error: dict[str, Any] = body["error"]
    return error


def test_error_answers_validate_against_openais_error_response(tmp_path: Path) -> None:
    gw = Gateway(tmp_path, CONFIG).start()
    (tmp_path / "standby").mkdir()
    standby = Gateway(tmp_path / "standby", CONFIG)
    try:
        with cf.ThreadPoolExecutor(2) as pool, gw.client() as client:
            post = client.post
            unknown = openai_error(
                post("/v1/chat/completions", json=chat("nope"), headers=bearer(USER)), 404
            )
            assert unknown["code"] == "model_not_found" and unknown["param"] == "model"
            bad_json = openai_error(
                post(
                    "/v1/chat/completions",
                    content=b"{not json",
                    headers=bearer(USER) | {"content-type": "application/json"},
                ),
                400,
            )
            assert bad_json["code"] == "invalid_json" and bad_json["param"] is None
            assert openai_error(post("/v1/chat/completions", json=chat()), 401)["param"] is None
            assert openai_error(client.get("/v1/nowhere", headers=bearer(USER)), 404)
            assert openai_error(client.get("/v1/jobs/nope", headers=bearer(USER)), 404)
            # A bad query parameter is named in `param`, whoever checked it:
            # Litestar's validation of a typed parameter, or the route itself.
            for url, param in (
                ("/api/activity?limit=x", "limit"),
                ("/v1/jobs?limit=abc", "limit"),
                ("/v1/batches?limit=1.5", "limit"),
                ("/ui/api/history?hours=x", "hours"),
                ("/ui/api/timeline?whole=maybe", "whole"),
                ("/api/queue?offset=-1", "offset"),
                ("/v1/jobs?status=done", "status"),
                ("/ui/api/history?band=urgent", "band"),
                ("/v1/files?limit=x", "limit"),
            ):
                error = openai_error(client.get(url, headers=bearer(ADMIN)), 400)
                assert error["param"] == param, (url, error)
                assert repr(param) in error["message"] or param in error["message"], error
            unload = openai_error(post("/api/models/unload/nope", headers=bearer(ADMIN)), 404)
            assert unload["code"] == "model_not_found"
            cross_site = bearer(ADMIN) | {"Origin": "http://evil.example"}
            assert openai_error(client.get("/unload", headers=cross_site), 403)["param"] is None

            # 429: one running, the user's one waiting, and one more.
            release = tmp_path / "release"
            running = pool.submit(
                post,
                "/v1/chat/completions",
                json=chat(hold_file=str(release)),
                headers=bearer(ADMIN),
            )
            queue = "/api/queue"
            poll(lambda: client.get(queue, headers=bearer(ADMIN)).json()["running"], "running")
            waiting = pool.submit(post, "/v1/chat/completions", json=chat(), headers=bearer(USER))
            poll(lambda: client.get(queue, headers=bearer(ADMIN)).json()["waiting"], "waiting")
            full = openai_error(
                post("/v1/chat/completions", json=chat(), headers=bearer(USER)), 429
            )
            assert full["code"] == "caller_queue_full"
            release.touch()
            assert running.result(60).status_code == 200
            assert waiting.result(60).status_code == 200

        # 503: a standby of the same database answers every request so.
        standby.db = gw.db
        standby.args = ["--standby"]
        standby.start()
        with standby.client() as client:
            refused = client.post("/v1/chat/completions", json=chat(), headers=bearer(USER))
            assert openai_error(refused, 503)["code"] == "standby"
    finally:
        standby.stop()
        gw.stop()


def test_a_streamed_or_raw_error_has_param_too() -> None:
    """The envelopes written outside a route: the HTTP protocol's refusals
    (error_body) and an error event in a stream (sse_error)."""
    for body in (
        json.loads(error_body(404, "no route")),
        json.loads(sse_error("upstream went away").removeprefix(b"data: ")),
    ):
        jsonschema.Draft202012Validator(SCHEMA).validate(body)
