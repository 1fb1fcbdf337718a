"""Rounds of renders, chats and cancels on a fake ComfyUI (issue 40): none
stopped mid-render, none overlapping on the lane, none lost, each ended by one
terminal event, and the log passes `db check` and `replay --verify`. A short
run of bench/render_rounds.py (`python -m bench.render_rounds --rounds 50`)."""

from __future__ import annotations

from pathlib import Path

from bench.render_rounds import config, run_rounds
from tests.e2e.gateway import Gateway


def test_rounds_of_renders_chats_and_cancels_lose_and_break_nothing(tmp_path: Path) -> None:
    record = tmp_path / "renders.jsonl"
    gw = Gateway(tmp_path, config(record)).start()
    try:
        summary = run_rounds(gw, record, rounds=8, seed=3)
    finally:
        gw.stop()
    assert summary.ok, "\n".join(summary.lines())
    assert summary.cancelled and len(summary.prompts) >= 8


def test_rounds_with_comfyui_asleep_between_them_never_free_a_render(tmp_path: Path) -> None:
    """The same with `sleep: comfyui`: every swap puts ComfyUI to sleep by `POST
    /free` instead of stopping it, never while a render runs (nor after a
    cancel, until ComfyUI's queue is idle), and its prompts wake one process."""
    record = tmp_path / "renders.jsonl"
    gw = Gateway(tmp_path, config(record, sleep=True)).start()
    try:
        summary = run_rounds(gw, record, rounds=8, seed=3)
    finally:
        gw.stop()
    assert summary.ok, "\n".join(summary.lines())
    assert summary.swaps["process_started"] == 1, summary.swaps  # one process, no cold start
    assert summary.swaps["process_slept"] >= 7 and summary.swaps["process_woken"] >= 7
