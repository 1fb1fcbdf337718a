"""Rounds of videos, chats and deletes through the Videos API (issue 41): none
stopped mid-render, none overlapping on the lane, none lost (a completed one's
content served after its server was swapped out), each ended by one terminal
event, and the log passes `db check` and `replay --verify`. A short run of
bench/video_rounds.py (`python -m bench.video_rounds --rounds 50`)."""

from __future__ import annotations

from pathlib import Path

from bench.video_rounds import config, run_rounds
from tests.e2e.gateway import Gateway


def test_rounds_of_videos_chats_and_deletes_lose_and_break_nothing(tmp_path: Path) -> None:
    record = tmp_path / "videos.jsonl"
    gw = Gateway(tmp_path, config(record)).start()
    try:
        summary, lags = run_rounds(gw, record, rounds=8, seed=3)
    finally:
        gw.stop()
    assert summary.ok, "\n".join(summary.lines() + lags)
    assert summary.cancelled and len(summary.prompts) >= 8
