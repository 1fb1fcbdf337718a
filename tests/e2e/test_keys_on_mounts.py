"""With apiKeys, the mounted apps (`/comfyui`, `/v1/videos`, `/upstream`) ask
for a key like every other route, their own bare path included.

Routing rewrites a mounted app's path to what follows the mount (`/comfyui`
becomes `/`, `/comfyui/ui` becomes `/ui/`), so a key check that ran after it
took those for the console's open pages. The real server in front of
tools/fake_comfyui.py and tools/fake_video_server.py.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.e2e.gateway import Gateway
from tests.e2e.test_renders import comfy_config, history, workflow

Start = Callable[[str], Gateway]
KEYS = textwrap.dedent(
    """
    apiKeys:
      - {key: sk-admin-0000000000, label: admin, role: admin}
      - {key: sk-alice-0000000000, label: alice, role: user}
    """
)
ALICE = {"Authorization": "Bearer sk-alice-0000000000"}
GUARDED = [
    ("GET", "/comfyui"),
    ("POST", "/comfyui"),
    ("GET", "/comfyui/"),
    ("POST", "/comfyui/prompt"),
    ("GET", "/comfyui/history"),
    ("GET", "/comfyui/ui"),
    ("GET", "/comfyui/ui/static/app.js"),
    ("GET", "/v1/videos"),
    ("POST", "/v1/videos"),
    ("GET", "/v1/videos/"),
    ("GET", "/v1/videos/ui"),
    ("GET", "/upstream/ui/"),
    ("GET", "/upstream/health"),
    ("GET", "/upstream/comfyui_auto/"),
    ("GET", "/unload"),
]


def test_every_mount_asks_for_a_key_and_a_user_key_works_as_documented(
    gateway: Start, tmp_path: Path
) -> None:
    fake = f"{sys.executable} -m tools.fake_video_server"
    video = textwrap.dedent(
        f"""
          sora-local:
            kind: openai-videos
            cmd: {fake} --port ${{PORT}} --record {tmp_path / "videos.jsonl"}
            checkEndpoint: /health
        """
    )
    gw = gateway(comfy_config(tmp_path / "renders.jsonl", keys=KEYS, extra=video))
    with gw.client() as anonymous:
        for method, path in GUARDED:
            r = anonymous.request(method, path, json={"prompt": workflow(0.1)})
            assert r.status_code == 401, (method, path, r.status_code, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key", (method, path, r.text)
        # Still open without a key: the health check and the console's shells.
        for path in ("/health", "/health/", "/ui/", "/ui/models"):
            assert anonymous.get(path).status_code == 200, path
    socket_url = gw.url.replace("http", "ws", 1)
    for path in ("/comfyui/ws", "/upstream/comfyui_auto/ws"):
        with pytest.raises(InvalidStatus) as refused:
            connect(f"{socket_url}{path}?clientId=x", open_timeout=10).close()
        assert refused.value.response.status_code == 401, path
    # /comfyui/ws is gpulane's own: a user key hears its own prompts there.
    with connect(f"{socket_url}/comfyui/ws", additional_headers=ALICE, open_timeout=10) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "status"
    with gw.client(headers=ALICE) as alice:
        # Not running yet: nothing but a prompt loads ComfyUI (docs/renders.md).
        bare = alice.get("/comfyui")
        assert bare.status_code == 409, bare.text
        assert bare.json()["error"]["code"] == "model_not_loaded"
        r = alice.post("/comfyui/prompt", json={"prompt": workflow(0.2)})
        assert r.status_code == 200, r.text
        prompt_id = r.json()["prompt_id"]
        assert history(alice, prompt_id)[prompt_id]["status"]["completed"] is True
        assert alice.get("/comfyui/").status_code == 200
        assert alice.get("/v1/videos").json()["object"] == "list"
        # An upstream's own pages stay admin-only.
        forbidden = alice.get("/upstream/comfyui_auto/")
        assert forbidden.status_code == 403, forbidden.text
        assert forbidden.json()["error"]["code"] == "admin_key_required"
