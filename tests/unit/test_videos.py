"""The Videos API's parts without a server: the docs' config, the content kept on disk."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from app.config import parse_config
from app.jobs.videos import VideoStore
from app.runtime.parameters import server_started

DOC = Path(__file__).resolve().parents[2] / "docs" / "renders.md"


def test_the_videos_config_in_the_docs_loads_as_pasted_with_a_held_video_server() -> None:
    section = DOC.read_text().split("## The Videos API", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    config = parse_config(block.group(1))
    assert config.models["wan-video"].kind == "openai-videos"
    assert config.models["qwen"].kind is None
    assert config.max_video_bytes == 20 * 1024**3
    assert server_started(config, 0, 0).held == ["wan-video"]


def kept(store: VideoStore, video_id: str, size: int, age_s: float = 0) -> bool:
    partial = store.partial(video_id, "video")
    partial.write_bytes(b"v" * size)
    if age_s:
        then = time.time() - age_s
        os.utime(partial, (then, then))
    return store.keep(video_id, "video", partial)


def test_past_the_cap_the_oldest_content_goes_first_never_the_one_just_kept(
    tmp_path: Path,
) -> None:
    store = VideoStore(tmp_path / "videos", cap=250, retention_s=3600)
    assert kept(store, "video_a", 100, age_s=30)
    assert kept(store, "video_b", 100, age_s=20)
    assert kept(store, "video_c", 100)  # 300 > 250: the oldest, a, goes
    assert [store.has(v, "video") for v in ("video_a", "video_b", "video_c")] == [
        False,
        True,
        True,
    ]
    # One larger than the whole cap is not kept, and removes nothing.
    assert not kept(store, "video_d", 251)
    assert not store.has("video_d", "video") and store.has("video_b", "video")
    assert not list((tmp_path / "videos").glob(".*.part"))


def test_content_past_the_retention_is_pruned(tmp_path: Path) -> None:
    store = VideoStore(tmp_path / "videos", cap=10**9, retention_s=60)
    assert kept(store, "video_old", 10, age_s=120)
    assert kept(store, "video_new", 10)  # each keep prunes too
    assert not store.has("video_old", "video") and store.has("video_new", "video")
    then = time.time() - 120
    os.utime(store.path("video_new", "video"), (then, then))
    assert store.prune() == 1 and not store.has("video_new", "video")
    assert kept(store, "video_new", 10)
    store.delete("video_new")
    assert not store.has("video_new", "video")
