"""Waiting for a condition in a test, always with a deadline: a regression fails
the test naming what never happened, instead of hanging the run."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


async def wait_until(check: Callable[[], Any], what: str, timeout: float = 30) -> Any:
    """Poll `check()` on the running event loop until it is truthy; return it.
    Fails with `what` when `timeout` seconds pass first (a guard against a hang,
    generous for a loaded host: it returns as soon as `check()` is truthy)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (result := check()):
        assert loop.time() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(0.005)
    return result
