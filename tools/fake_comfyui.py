"""A fake ComfyUI server for tests and benchmarks: renders in the background.

    python -m tools.fake_comfyui --port N [--name NAME] [--record FILE]

Written from ComfyUI's own source, v0.3.64 (Comfy-Org/ComfyUI a125cd84,
2025-10-12): `server.py` (the routes and their answers) and `execution.py`
(`PromptQueue`, the history entry, the status messages). What it keeps of them:

- `POST /prompt` takes `{"prompt": {...}, "prompt_id"?, "client_id"?,
  "extra_data"?, "front"?, "number"?}`, validates the workflow (every node's
  `class_type` known, at least one output node), queues it and answers at once
  `{"prompt_id", "number", "node_errors": {}}`; a bad workflow is 400
  `{"error": {"type", "message", "details", "extra_info"}, "node_errors"}`.
  A prompt id the client gives is used as given; else a new uuid4.
- One worker thread renders one prompt at a time, in `(number, ...)` heap order
  (`front` negates the number), as ComfyUI's `prompt_worker` does.
- `GET /history/{id}` is `{}` until the prompt ends, then `{id: {"prompt":
  [number, id, prompt, extra_data, outputs], "outputs", "status": {"status_str":
  "success"|"error", "completed", "messages": [[event, data], ...]}, "meta"}}`;
  `GET /history` has every entry; `POST /history {clear|delete}`.
- `GET /queue` is `{"queue_running": [...], "queue_pending": [...]}` (the same
  items); `POST /queue {clear|delete}` drops pending prompts only.
- `POST /interrupt` (optionally `{"prompt_id"}`: only if that one runs) stops
  the running render at its next step: `execution_interrupted`, status error.
- `POST /free` (`server.py` `post_free`, `main.py` `prompt_worker`): the body
  must be JSON (ComfyUI's handler reads `request.json()`: no body is a 500);
  `unload_models` and `free_memory` only set flags on the queue, waking an idle
  worker, and the answer is 200 with no body at once. The worker acts on the
  flags between prompts: at once when idle, else after the running prompt
  (and before the next). `free_memory` alone unloads too, as in ComfyUI. The
  models are loaded again by the next prompt (`--load-time` seconds).
- `GET /prompt` (`exec_info.queue_remaining`), `GET /system_stats`, `GET
  /object_info`, `GET /view?filename=` (a few bytes).
- `GET /ws?clientId=ID` is ComfyUI's websocket (`server.py`
  `websocket_handler`): a socket named ID (a new uuid without one; the newest
  connection with an ID takes it, and any closing one drops it), first sent
  `status` (`{"status": {"exec_info": ...}, "sid"}`), then JSON text messages
  `{"type", "data"}`. As ComfyUI (`execution.py` `add_message`, `main.py`
  `hijack_progress` and `prompt_worker`): `progress` (`{"value", "max",
  "prompt_id", "node"}`, one per step) goes to the prompt's `client_id`, or to
  every socket when the prompt has none; `executing` and the status messages
  (`execution_start`, `execution_success`, ...) only to a prompt's `client_id`,
  except `execution_interrupted`, which a prompt without one broadcasts. A
  binary preview (`PREVIEW_IMAGE` 1, image type 1, then the bytes) follows each
  `progress`, to the same sockets. Every change of the queue (a prompt put, a
  prompt done) sends every socket `status` without `sid` (`queue_updated`), and
  a prompt's last message is `executing` with `node: null`, sent after its
  history entry is written (`main.py` `prompt_worker`).

The fake's own nodes: `FakeRender` (inputs `seconds` (1.0), `steps` (10),
`fail` (false): an `execution_error` at the last step, `last_message_after`
(0): seconds between writing the history entry and the last `executing`,
`hold_file` (a path): its last step waits until that file exists, at most
120 s, so a test decides when a render ends) and `SaveImage`; both are output
nodes. `--output DIR` writes each output image there, as ComfyUI writes its
`output/` folder. `--record FILE` appends a JSON line per render start and
end, and one when SIGTERM arrives mid-render (`stopped_mid_render`), so a test
can tell whether two renders overlapped or a server was stopped inside one.
It records `free_requested` (with the prompt `rendering` then, or null),
`models_freed` when the worker acts on the flags, and `models_loaded` when a
prompt loads the models. `--gpu-dir DIR --gpu-mib N` holds N MiB of a fake GPU
shared by files (app/runtime/gpu_file.py, `GPULANE_FAKE_GPU`) while the models
are loaded, and `--gpu-context-mib M` (default 0) from its start to its exit,
as a CUDA context stays after ComfyUI unloads.
Standard library only, so it starts in tens of milliseconds.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import heapq
import json
import os
import signal
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, BinaryIO
from urllib.parse import parse_qs, urlsplit

from tools.fake_upstream import _gpu_hold

VERSION = "0.3.64"
NODES = {"FakeRender", "SaveImage", "KSampler", "CheckpointLoaderSimple", "CLIPTextEncode"}
OUTPUT_NODES = {"FakeRender", "SaveImage"}


WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455


def log(line: str) -> None:
    print(line, flush=True)


def _hold(path: str, stopped: Callable[[], bool]) -> None:
    """Until `path` exists (a test's release), `stopped()` or 120 s."""
    deadline = time.monotonic() + 120
    while not os.path.exists(path) and not stopped() and time.monotonic() < deadline:
        time.sleep(0.02)


class Socket:
    """One websocket client: text frames out, whoever's thread sends them."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.lock = threading.Lock()

    def send_frame(self, opcode: int, payload: bytes) -> None:
        size = len(payload)
        if size < 126:
            head = bytes([0x80 | opcode, size])
        elif size < 1 << 16:
            head = bytes([0x80 | opcode, 126]) + size.to_bytes(2, "big")
        else:
            head = bytes([0x80 | opcode, 127]) + size.to_bytes(8, "big")
        with self.lock:
            self.out.write(head + payload)
            self.out.flush()

    def send_json(self, event: str, data: dict[str, Any]) -> None:
        try:
            self.send_frame(0x1, json.dumps({"type": event, "data": data}).encode())
        except OSError:
            pass  # ComfyUI's send_socket_catch_exception: a gone client is no error


def read_frame(stream: BinaryIO) -> tuple[int, bytes] | None:
    """(opcode, payload) of the client's next frame; None at the end."""
    head = stream.read(2)
    if len(head) < 2:
        return None
    opcode, size = head[0] & 0x0F, head[1] & 0x7F
    if size == 126:
        size = int.from_bytes(stream.read(2), "big")
    elif size == 127:
        size = int.from_bytes(stream.read(8), "big")
    mask = stream.read(4) if head[1] & 0x80 else b"\0\0\0\0"
    data = stream.read(size)
    return opcode, bytes(b ^ mask[i % 4] for i, b in enumerate(data))


class Queue:
    """ComfyUI's PromptQueue, cut to what a client sees."""

    def __init__(
        self,
        name: str,
        record: str | None,
        output: str | None = None,
        gpu: tuple[str, int, int] | None = None,
        load_time: float = 0.0,
    ) -> None:
        self.name = name
        self.record = record
        self.output = output
        self.gpu = gpu
        """(directory, MiB while the models are loaded, MiB always), or None."""
        self.load_time = load_time
        self.loaded = False
        """Whether the models are in (fake) GPU memory: from a prompt to a /free."""
        self.flags: dict[str, Any] = {}
        """ComfyUI's queue flags (`set_flag`, `get_flags`): what /free asked."""
        self.lock = threading.RLock()
        self.not_empty = threading.Condition(self.lock)
        self.pending: list[tuple[float, str, dict[str, Any], dict[str, Any], list[str]]] = []
        self.running: tuple[float, str, dict[str, Any], dict[str, Any], list[str]] | None = None
        self.history: dict[str, dict[str, Any]] = {}
        self.number = 0
        self.interrupted = False
        self.images = 0
        self.sockets: dict[str, Socket] = {}

    def send(self, event: str, data: dict[str, Any], sid: str | None) -> None:
        """ComfyUI's `send_json`: to socket SID, or to every socket when None."""
        with self.lock:
            targets = list(self.sockets.values()) if sid is None else [self.sockets.get(sid)]
        for socket in targets:
            if socket is not None:
                socket.send_json(event, data)

    def send_preview(self, image: bytes, sid: str | None) -> None:
        """ComfyUI's `send_bytes` of a preview (`hijack_progress`, where a preview
        method is set): a binary frame, PREVIEW_IMAGE (1) then the image type
        (1: JPEG), big-endian, then the image; to whom progress goes."""
        with self.lock:
            targets = list(self.sockets.values()) if sid is None else [self.sockets.get(sid)]
        for socket in targets:
            if socket is not None:
                with contextlib.suppress(OSError):
                    socket.send_frame(0x2, struct.pack(">II", 1, 1) + image)

    def queue_updated(self) -> None:
        """ComfyUI's `queue_updated`: the queue's `status` to every socket, no sid."""
        running, pending = self.items()
        status = {"exec_info": {"queue_remaining": len(running) + len(pending)}}
        self.send("status", {"status": status}, None)

    def put(self, item: tuple[float, str, dict[str, Any], dict[str, Any], list[str]]) -> None:
        with self.lock:
            heapq.heappush(self.pending, item)
            self.not_empty.notify()
        self.queue_updated()

    def note(self, event: str, **fields: Any) -> None:
        if self.record is None:
            return
        line = json.dumps({"event": event, "at": time.time(), "pid": os.getpid(), **fields})
        with open(self.record, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def set_flag(self, name: str, value: Any) -> None:
        """ComfyUI's `set_flag`: notifies, so an idle worker acts on it at once."""
        with self.lock:
            self.flags[name] = value
            self.not_empty.notify()

    def hold_gpu(self) -> None:
        if self.gpu is not None:
            directory, weights, context = self.gpu
            _gpu_hold(directory, os.getpid(), {"mib": context + (weights if self.loaded else 0)})

    def work(self) -> None:
        """ComfyUI's `prompt_worker`: a prompt if one waits, then the flags."""
        while True:
            item = None
            with self.not_empty:
                while not self.pending and not self.flags:
                    self.not_empty.wait()
                if self.pending:
                    item = heapq.heappop(self.pending)
                    self.running = item
                    self.interrupted = False
            if item is not None:
                self.execute(item)
            with self.lock:
                flags, self.flags = self.flags, {}
            free_memory = flags.get("free_memory", False)
            if flags.get("unload_models", free_memory):
                self.loaded = False  # unload_all_models, e.reset(), soft_empty_cache
                self.hold_gpu()
                self.note("models_freed", free_memory=bool(free_memory))

    def execute(self, item: tuple[float, str, dict[str, Any], dict[str, Any], list[str]]) -> None:
        number, prompt_id, prompt, extra, outputs = item
        messages: list[list[Any]] = []
        client = extra.get("client_id")

        def add(event: str, data: dict[str, Any], broadcast: bool = False) -> None:
            data = {**data, "timestamp": int(time.time() * 1000)}
            messages.append([event, data])
            if client is not None or broadcast:
                self.send(event, data, client)

        add("execution_start", {"prompt_id": prompt_id})
        add("execution_cached", {"nodes": [], "prompt_id": prompt_id})
        self.note("render_started", prompt_id=prompt_id)
        if not self.loaded:  # the first prompt, or the first after a /free
            time.sleep(self.load_time)
            self.loaded = True
            self.hold_gpu()
            self.note("models_loaded", prompt_id=prompt_id)
        success, ui = True, {}
        renders = [(nid, n) for nid, n in prompt.items() if n["class_type"] == "FakeRender"]
        for node_id, node in renders or [("0", {"class_type": "SaveImage", "inputs": {}})]:
            inputs = node.get("inputs", {})
            seconds = float(inputs.get("seconds", 1.0 if renders else 0.1))
            steps = max(1, int(inputs.get("steps", 10)))
            if client is not None:
                where = {"node": node_id, "display_node": node_id, "prompt_id": prompt_id}
                self.send("executing", where, client)
            for step in range(steps):
                if step == steps - 1 and inputs.get("hold_file"):
                    _hold(str(inputs["hold_file"]), lambda: self.interrupted)
                time.sleep(seconds / steps)
                if self.interrupted:
                    break
                progress = {"value": step + 1, "max": steps, "prompt_id": prompt_id}
                self.send("progress", progress | {"node": node_id}, client)
                self.send_preview(f"fake preview {prompt_id} {step + 1}".encode(), client)
            if self.interrupted:
                add("execution_interrupted", _where(prompt_id, node_id, node), broadcast=True)
                success = False
                break
            if inputs.get("fail"):
                add(
                    "execution_error",
                    _where(prompt_id, node_id, node)
                    | {"exception_message": "fake failure", "exception_type": "RuntimeError"},
                )
                success = False
                break
        if success:
            for node_id in outputs:
                with self.lock:
                    self.images += 1
                    name = f"{self.name}_{self.images:05}_.png"
                ui[node_id] = {"images": [{"filename": name, "subfolder": "", "type": "output"}]}
                if self.output is not None:
                    with open(os.path.join(self.output, name), "wb") as f:
                        f.write(image_bytes(self.name, name))
            add("execution_success", {"prompt_id": prompt_id})
        outcome = "success" if success else ("interrupted" if self.interrupted else "error")
        self.note("render_ended", prompt_id=prompt_id, outcome=outcome)
        with self.lock:
            self.running = None
            self.history[prompt_id] = {
                "prompt": [number, prompt_id, prompt, extra, outputs],
                "outputs": ui,
                "status": {
                    "status_str": "success" if success else "error",
                    "completed": success,
                    "messages": messages,
                },
                "meta": {nid: {"node_id": nid} for nid in ui},
            }
        self.queue_updated()
        # After the history entry, as ComfyUI's prompt_worker (task_done first);
        # `last_message_after` stretches the gap, as a busy publish loop does.
        inputs = [n.get("inputs", {}) for n in prompt.values()]
        time.sleep(max([float(i.get("last_message_after", 0)) for i in inputs] + [0.0]))
        if client is not None:
            self.send("executing", {"node": None, "prompt_id": prompt_id}, client)

    def items(self) -> tuple[list[list[Any]], list[list[Any]]]:
        with self.lock:
            running = [list(self.running)] if self.running is not None else []
            return running, [list(x) for x in self.pending]


def image_bytes(server: str, name: str) -> bytes:
    """What the fake renders into an image: its name and the server's."""
    return f"fake image {name} from {server}".encode()


def _where(prompt_id: str, node_id: str, node: dict[str, Any]) -> dict[str, Any]:
    return {"prompt_id": prompt_id, "node_id": node_id, "node_type": node["class_type"]}


def _invalid(kind: str, message: str, details: str = "") -> dict[str, Any]:
    error = {"type": kind, "message": message, "details": details, "extra_info": {}}
    return {"error": error, "node_errors": {}}


def validate(prompt: Any) -> tuple[dict[str, Any] | None, list[str]]:
    """ComfyUI's validate_prompt, cut down: (error body or None, output nodes)."""
    if not isinstance(prompt, dict):
        return _invalid("invalid_prompt", "Invalid prompt: not a JSON object"), []
    for node_id, node in prompt.items():
        if not isinstance(node, dict) or "class_type" not in node:
            message = "Cannot execute because a node is missing the class_type property."
            return _invalid("invalid_prompt", message, f"Node ID '#{node_id}'"), []
        if node["class_type"] not in NODES:
            message = f"Cannot execute because node {node['class_type']} does not exist."
            return _invalid("invalid_prompt", message, f"Node ID '#{node_id}'"), []
    outputs = [nid for nid, n in prompt.items() if n["class_type"] in OUTPUT_NODES]
    if not outputs:
        return _invalid("prompt_no_outputs", "Prompt has no outputs"), []
    return None, outputs


class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log(f"{self.server.queue.name} {self.command} {self.path}")

    def _json(self, status: int, doc: Any) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self) -> Any:
        size = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(size) if size else b""
        try:
            return json.loads(raw or b"{}")
        except ValueError:
            return None

    def do_GET(self) -> None:
        q = self.server.queue
        url = urlsplit(self.path)
        path = url.path
        if path == "/ws":
            self._websocket(parse_qs(url.query).get("clientId", [""])[0])
        elif path in ("/", "/index.html"):
            body = f"<html><body>fake ComfyUI {q.name}</body></html>".encode()
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif path == "/system_stats":
            system = {"os": sys.platform, "comfyui_version": VERSION, "python_version": "3"}
            self._json(200, {"system": system | {"fake": q.name}, "devices": []})
        elif path == "/object_info":
            self._json(200, {name: {"name": name} for name in sorted(NODES)})
        elif path == "/prompt":
            running, pending = q.items()
            self._json(200, {"exec_info": {"queue_remaining": len(running) + len(pending)}})
        elif path == "/queue":
            running, pending = q.items()
            self._json(200, {"queue_running": running, "queue_pending": pending})
        elif path == "/history":
            with q.lock:
                self._json(200, dict(q.history))
        elif path.startswith("/history/"):
            prompt_id = path.removeprefix("/history/")
            with q.lock:
                entry = q.history.get(prompt_id)
            self._json(200, {} if entry is None else {prompt_id: entry})
        elif path == "/view":
            name = parse_qs(url.query).get("filename", [""])[0]
            body = image_bytes(q.name, name)
            self.send_response(200)
            self.send_header("content-type", "image/png")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self._json(404, {"error": f"no route {path}"})

    def _websocket(self, sid: str) -> None:
        q = self.server.queue
        key = self.headers.get("sec-websocket-key")
        if "websocket" not in (self.headers.get("upgrade") or "").lower() or not key:
            self._json(400, {"error": "a websocket upgrade is expected"})
            return
        accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True
        sid = sid or uuid.uuid4().hex
        socket = Socket(self.wfile)
        with q.lock:
            q.sockets[sid] = socket  # as ComfyUI: the newest connection takes the id
        try:
            running, pending = q.items()
            status = {"exec_info": {"queue_remaining": len(running) + len(pending)}}
            socket.send_json("status", {"status": status, "sid": sid})
            while (frame := read_frame(self.rfile)) is not None:
                opcode, payload = frame
                if opcode == 0x8:
                    with contextlib.suppress(OSError):
                        socket.send_frame(0x8, payload[:2])
                    break
                if opcode == 0x9:
                    with contextlib.suppress(OSError):
                        socket.send_frame(0xA, payload)
        except OSError:
            pass
        finally:
            with q.lock:
                q.sockets.pop(sid, None)  # as ComfyUI, whichever socket holds the id now

    def do_POST(self) -> None:
        q = self.server.queue
        path = urlsplit(self.path).path
        doc = self._body()
        if doc is None:
            self._json(400, _invalid("invalid_json", "the body is not JSON"))
            return
        if path == "/prompt":
            self._prompt(doc)
        elif path == "/queue":
            with q.lock:
                if doc.get("clear"):
                    q.pending = []
                for prompt_id in doc.get("delete", []):
                    q.pending = [x for x in q.pending if x[1] != prompt_id]
                    heapq.heapify(q.pending)
            self._json(200, {})
        elif path == "/interrupt":
            wanted = doc.get("prompt_id")
            with q.lock:
                running = q.running
                if running is not None and (not wanted or running[1] == wanted):
                    q.interrupted = True
            self._json(200, {})
        elif path == "/history":
            with q.lock:
                if doc.get("clear"):
                    q.history = {}
                for prompt_id in doc.get("delete", []):
                    q.history.pop(prompt_id, None)
            self._json(200, {})
        elif path == "/free":
            self._free(doc)
        else:
            self._json(404, {"error": f"no route {path}"})

    def _free(self, doc: dict[str, Any]) -> None:
        """ComfyUI's `post_free`: flags for the worker, answered at once."""
        q = self.server.queue
        if not int(self.headers.get("content-length") or 0):
            self._json(500, {"error": "request.json(): no body"})  # aiohttp's 500
            return
        unload, free = doc.get("unload_models", False), doc.get("free_memory", False)
        running = q.running
        q.note(
            "free_requested",
            unload_models=unload,
            free_memory=free,
            rendering=None if running is None else running[1],
        )
        if unload:
            q.set_flag("unload_models", unload)
        if free:
            q.set_flag("free_memory", free)
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def _prompt(self, doc: dict[str, Any]) -> None:
        q = self.server.queue
        if "prompt" not in doc:
            self._json(400, _invalid("no_prompt", "No prompt provided", "No prompt provided"))
            return
        with q.lock:
            if "number" in doc:
                number = float(doc["number"])
            else:
                number = -q.number if doc.get("front") else q.number
                q.number += 1
        prompt_id = str(doc.get("prompt_id") or uuid.uuid4())
        error, outputs = validate(doc["prompt"])
        if error is not None:
            self._json(400, error)
            return
        extra = dict(doc.get("extra_data") or {})
        if "client_id" in doc:
            extra["client_id"] = doc["client_id"]
        q.put((number, prompt_id, doc["prompt"], extra, outputs))
        self._json(200, {"prompt_id": prompt_id, "number": number, "node_errors": {}})


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], queue: Queue) -> None:
        super().__init__(address, Handler)
        self.queue = queue


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.fake_comfyui", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--name", default="comfy")
    parser.add_argument("--record", default=None, help="append render starts and ends here")
    parser.add_argument("--output", default=None, help="write each output image here")
    parser.add_argument("--load-time", type=float, default=0.0, help="a prompt's model load")
    parser.add_argument("--gpu-dir", help="a fake GPU shared by files (app/runtime/gpu_file.py)")
    parser.add_argument("--gpu-mib", type=int, default=0, help="held while models are loaded")
    parser.add_argument("--gpu-context-mib", type=int, default=0, help="held from start to exit")
    args = parser.parse_args(argv)
    gpu = (args.gpu_dir, args.gpu_mib, args.gpu_context_mib) if args.gpu_dir else None
    queue = Queue(args.name, args.record, args.output, gpu, args.load_time)
    queue.hold_gpu()

    def on_sigterm(signum: int, frame: object) -> None:
        running = queue.running
        if running is not None:
            queue.note("stopped_mid_render", prompt_id=running[1])
        log(f"{args.name} received SIGTERM, exiting")
        if gpu is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(gpu[0], f"{os.getpid()}.json"))
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    server = Server((args.host, args.port), queue)
    threading.Thread(target=queue.work, daemon=True, name="prompt_worker").start()
    log(f"{args.name} fake ComfyUI {VERSION} on http://{args.host}:{args.port} pid={os.getpid()}")
    server.serve_forever(poll_interval=0.5)


if __name__ == "__main__":
    main()
