"""What /proc says of the processes tests start: read by the session's
leftover check (tests/conftest.py) and by Gateway.stop (tests/e2e/gateway.py).
Independent of app/runtime/process_table.py on purpose: the check must not
share a bug with the code it checks."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")


def parents() -> dict[int, int]:
    """pid -> parent pid of every live process (zombies aside)."""
    found = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
        except OSError:
            continue  # gone meanwhile
        # The command name may hold spaces or parentheses: the fields follow the last ')'.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields[0] not in (b"Z", b"X"):
            found[int(entry.name)] = int(fields[1])
    return found


def environ_value(pid: int, name: str) -> str | None:
    """The value of `name` in a process's environment, if it has it."""
    try:
        environ = (PROC / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None  # gone meanwhile, or not ours to read
    prefix = os.fsencode(name) + b"="
    entry = next((e for e in environ if e.startswith(prefix)), None)
    return None if entry is None else os.fsdecode(entry[len(prefix) :])


def cmdline(pid: int) -> str:
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    return " ".join(a.decode(errors="replace") for a in argv if a)


def cwd(pid: int) -> Path | None:
    try:
        return Path(os.readlink(PROC / str(pid) / "cwd"))
    except OSError:
        return None


def carrying(name: str, value: str) -> dict[int, str]:
    """Live processes whose environment sets `name` to `value`: pid -> command line."""
    return {pid: cmdline(pid) for pid in parents() if environ_value(pid, name) == value}


def kill_and_wait(pids: Iterable[int], timeout: float = 5) -> None:
    """SIGKILL each of `pids`, then wait until none is alive (or `timeout`)."""
    pids = set(pids)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while pids & parents().keys() and time.monotonic() < deadline:
        time.sleep(0.02)
