from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.e2e.gateway import Gateway


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Callable[[str], Gateway]]:
    """Factory: gateway(config_yaml) starts `gpulane serve`; all are stopped at teardown."""
    started: list[Gateway] = []

    def start(config_text: str) -> Gateway:
        gw = Gateway(tmp_path, config_text).start()
        started.append(gw)
        return gw

    yield start
    for gw in started:
        gw.stop()
