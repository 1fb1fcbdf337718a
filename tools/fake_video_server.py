"""A fake video server for tests and benchmarks: OpenAI's Videos API, rendered in the background.

    python -m tools.fake_video_server --port N [--render-s S] [--fail] [--sync]
        [--no-remix] [--no-variants] [--record FILE] [--hold-file PATH]

It speaks the shapes of OpenAI's OpenAPI spec (openai/openai-openapi f85dbe2:
`VideoResource`, `VideoListResource`, `DeletedVideoResource`, `Error-2`):

- `POST /v1/videos` (JSON or multipart/form-data: `prompt`, `model`, `seconds`,
  `size`, `input_reference`) answers at once with the video in `queued`; one
  worker thread renders one video at a time, in order: `in_progress` with
  `progress` rising by steps of 10, then `completed` (or `failed` with `error:
  {code, message}`: every video with `--fail`, or one whose prompt starts with
  `fail`). With `--sync` the POST renders before it answers, `completed`.
- `GET /v1/videos` (`limit`, `order`, `after`), `GET /v1/videos/{id}`,
  `DELETE /v1/videos/{id}` (a queued or rendering video is dropped: its render
  stops at its next step), `GET /v1/videos/{id}/content?variant=video|thumbnail|
  spritesheet` (deterministic bytes naming the video; `--no-variants`: 400 for
  anything but `video`), `POST /v1/videos/{id}/remix` (`--no-remix`: 404, as a
  server without the route answers).
- `GET /health`.

`--hold-file PATH` holds each render at its last step until that file exists
(at most 120 s), so a test decides when a render ends.

`--record FILE` appends a JSON line per render start (with the bytes of an
uploaded `input_reference`) and end, each naming the server's video id and
its prompt, and one when
SIGTERM arrives mid-render (`stopped_mid_render`), so a test can tell whether
two renders overlapped or the server was stopped inside one. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

STEPS = 10
MP4_HEAD = b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom"


def content_of(video_id: str, variant: str) -> bytes:
    """The bytes a finished video serves: the same for the same id and variant."""
    if variant == "video":
        return MP4_HEAD + f"fake video {video_id}".encode() + bytes(4096)
    return f"RIFF{variant} of {video_id}".encode()


class Videos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.lock = threading.Condition()
        self.videos: dict[str, dict[str, Any]] = {}
        self.order: list[str] = []
        self.pending: deque[str] = deque()
        self.running: str | None = None
        self.running_prompt: str | None = None
        self.references: dict[str, int] = {}
        """Video id -> the bytes of its uploaded `input_reference`."""

    def record(self, event: str, **fields: Any) -> None:
        if self.args.record is None:
            return
        line = {"event": event, "pid": os.getpid(), "at": time.time()} | fields
        with open(self.args.record, "a") as f:
            f.write(json.dumps(line) + "\n")

    def create(self, fields: dict[str, str], remixed_from: str | None = None) -> dict[str, Any]:
        video_id = "video_" + uuid.uuid4().hex
        video = {
            "id": video_id,
            "object": "video",
            "model": fields.get("model") or "sora-2",
            "status": "queued",
            "progress": 0,
            "created_at": int(time.time()),
            "completed_at": None,
            "expires_at": None,
            "prompt": fields.get("prompt"),
            "size": fields.get("size") or "720x1280",
            "seconds": fields.get("seconds") or "4",
            "remixed_from_video_id": remixed_from,
            "error": None,
        }
        reference = fields.get("input_reference_bytes")
        with self.lock:
            self.videos[video_id] = video
            if reference is not None:
                self.references[video_id] = int(reference)
            self.order.append(video_id)
        if self.args.sync:
            self.render(video_id)
        else:
            with self.lock:
                self.pending.append(video_id)
                self.lock.notify_all()
        return dict(video)

    def worker(self) -> None:
        while True:
            with self.lock:
                while not self.pending:
                    self.lock.wait()
                video_id = self.pending.popleft()
            self.render(video_id)

    def render(self, video_id: str) -> None:
        with self.lock:
            video = self.videos.get(video_id)
            if video is None or video["status"] != "queued":
                return
            video["status"] = "in_progress"
            self.running = video_id
            self.running_prompt = video.get("prompt")
        reference = self.references.get(video_id)
        prompt = video.get("prompt")
        self.record("render_started", video_id=video_id, prompt=prompt, reference_bytes=reference)
        failing = self.args.fail or str(video.get("prompt") or "").startswith("fail")
        outcome = "completed"
        for step in range(1, STEPS + 1):
            if step == STEPS and self.args.hold_file:
                deadline = time.monotonic() + 120
                while not os.path.exists(self.args.hold_file) and time.monotonic() < deadline:
                    with self.lock:
                        if video_id not in self.videos:
                            break
                    time.sleep(0.02)
            time.sleep(self.args.render_s / STEPS)
            with self.lock:
                if video_id not in self.videos:
                    outcome = "deleted"
                    break
                if failing and step == STEPS:
                    video["status"] = "failed"
                    video["error"] = {
                        "code": "video_generation_failed",
                        "message": "the fake renderer was told to fail",
                    }
                    outcome = "failed"
                    break
                video["progress"] = min(100, step * 100 // STEPS) if step < STEPS else 100
        with self.lock:
            if outcome == "completed":
                video["status"] = "completed"
                video["progress"] = 100
                video["completed_at"] = int(time.time())
            self.running = None
        self.record("render_ended", video_id=video_id, prompt=prompt, outcome=outcome)

    def stop(self, *_: Any) -> None:
        running = self.running
        if running is not None:
            self.record("stopped_mid_render", video_id=running, prompt=self.running_prompt)
        sys.exit(0)


def parse_form(body: bytes, content_type: str) -> dict[str, str]:
    boundary = content_type.split("boundary=", 1)[1].strip().strip('"').encode()
    out: dict[str, str] = {}
    for piece in body.split(b"--" + boundary):
        head, sep, value = piece.partition(b"\r\n\r\n")
        if not sep:
            continue
        for line in head.split(b"\r\n"):
            text = line.decode("utf-8", "replace")
            if text.lower().startswith("content-disposition") and 'name="' in text:
                name = text.split('name="', 1)[1].split('"', 1)[0]
                content = value.removesuffix(b"\r\n")
                if "filename=" not in text:
                    out[name] = content.decode("utf-8", "replace")
                else:  # an upload: the fake keeps its size, for the record
                    out[name + "_bytes"] = str(len(content))
    return out


def make_handler(videos: Videos) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_: Any) -> None:
            pass

        def answer(self, status: int, doc: Any, kind: str = "application/json") -> None:
            body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def error(self, status: int, message: str, code: str) -> None:
            error = {"message": message, "type": "invalid_request_error", "code": code}
            self.answer(status, {"error": error})

        def body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("content-length") or 0))

        def fields(self) -> dict[str, str] | None:
            raw = self.body()
            kind = self.headers.get("content-type") or ""
            if kind.startswith("multipart/form-data"):
                return parse_form(raw, kind)
            try:
                doc = json.loads(raw or b"{}")
            except ValueError:
                return None
            return {k: v for k, v in doc.items() if isinstance(v, str)}

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            parts = url.path.strip("/").split("/")
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            if url.path == "/health":
                self.answer(200, {"status": "ok"})
            elif url.path == "/v1/videos":
                self.list(query)
            elif len(parts) == 3 and parts[:2] == ["v1", "videos"]:
                with videos.lock:
                    video = videos.videos.get(parts[2])
                    found = None if video is None else dict(video)
                if found is None:
                    self.error(404, f"no video {parts[2]}", "video_not_found")
                else:
                    self.answer(200, found)
            elif len(parts) == 4 and parts[:2] == ["v1", "videos"] and parts[3] == "content":
                self.content(parts[2], query.get("variant") or "video")
            else:
                self.error(404, f"no route GET {url.path}", "not_found")

        def list(self, query: dict[str, str]) -> None:
            with videos.lock:
                ids = list(videos.order)
                if query.get("order", "desc") == "desc":
                    ids.reverse()
                if query.get("after") in ids:
                    ids = ids[ids.index(query["after"]) + 1 :]
                limit = int(query.get("limit") or 20)
                data = [dict(videos.videos[i]) for i in ids[:limit]]
            self.answer(
                200,
                {
                    "object": "list",
                    "data": data,
                    "first_id": data[0]["id"] if data else None,
                    "last_id": data[-1]["id"] if data else None,
                    "has_more": len(ids) > limit,
                },
            )

        def content(self, video_id: str, variant: str) -> None:
            with videos.lock:
                video = videos.videos.get(video_id)
                status = None if video is None else video["status"]
            if status is None:
                self.error(404, f"no video {video_id}", "video_not_found")
            elif status != "completed":
                self.error(400, f"video {video_id} is {status}", "video_not_ready")
            elif variant != "video" and videos.args.no_variants:
                self.error(400, f"variant {variant!r} is not supported", "invalid_variant")
            else:
                kind = "video/mp4" if variant == "video" else "image/webp"
                self.answer(200, content_of(video_id, variant), kind)

        def do_POST(self) -> None:
            parts = urlsplit(self.path).path.strip("/").split("/")
            fields = self.fields()
            if fields is None:
                self.error(400, "the body is not JSON", "invalid_json")
            elif parts == ["v1", "videos"]:
                if not fields.get("prompt"):
                    self.error(400, "prompt is required", "missing_prompt")
                    return
                self.answer(200, videos.create(fields))
            elif len(parts) == 4 and parts[:2] == ["v1", "videos"] and parts[3] == "remix":
                if videos.args.no_remix:
                    self.error(404, f"no route POST {self.path}", "not_found")
                    return
                with videos.lock:
                    source = videos.videos.get(parts[2])
                if source is None or source["status"] != "completed":
                    self.error(400, f"video {parts[2]} is not a completed video", "invalid_video")
                    return
                base = {k: source[k] for k in ("model", "size", "seconds")}
                self.answer(200, videos.create(base | fields, remixed_from=parts[2]))
            else:
                self.error(404, f"no route POST {self.path}", "not_found")

        def do_DELETE(self) -> None:
            parts = urlsplit(self.path).path.strip("/").split("/")
            if len(parts) != 3 or parts[:2] != ["v1", "videos"]:
                self.error(404, f"no route DELETE {self.path}", "not_found")
                return
            with videos.lock:
                video = videos.videos.pop(parts[2], None)
                if video is not None:
                    videos.order.remove(parts[2])
            if video is None:
                self.error(404, f"no video {parts[2]}", "video_not_found")
            else:
                self.answer(200, {"id": parts[2], "object": "video.deleted", "deleted": True})

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--render-s", type=float, default=2.0, help="seconds one render takes")
    parser.add_argument("--fail", action="store_true", help="every render fails at its end")
    parser.add_argument("--sync", action="store_true", help="POST answers once rendered")
    parser.add_argument("--no-remix", action="store_true")
    parser.add_argument("--no-variants", action="store_true")
    parser.add_argument("--record", default=None)
    parser.add_argument("--hold-file", default=None, help="each render's last step waits for it")
    args = parser.parse_args()
    videos = Videos(args)
    signal.signal(signal.SIGTERM, videos.stop)
    threading.Thread(target=videos.worker, daemon=True).start()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(videos))
    server.daemon_threads = True
    print(f"fake video server on {args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
