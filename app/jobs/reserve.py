"""The disk reserve (`jobs.minFreeDisk`): what a body or a file may not take."""

from __future__ import annotations

from sqlalchemy import Engine

from app.store.job_bodies import WAL_COPIES, disk_free


def disk_shortfall(engine: Engine, reserve: int, size: int, what: str) -> str | None:
    """Why `size` bytes of `what` ("this job: its body") may not be stored now,
    keeping `reserve` bytes free on the database's disk; None when they may."""
    found = disk_free(engine)
    if found is None:
        return None
    directory, free = found
    if free - WAL_COPIES * size >= reserve:
        return None
    return (
        f"not enough disk space for {what} ({_size(size)}) needs "
        f"{_size(WAL_COPIES * size)} while it is written (SQLite's write-ahead log, then "
        f"the database), the database's disk ({directory}) has {_size(free)} free, "
        f"and jobs.minFreeDisk keeps {_size(reserve)} in reserve; "
        "free space there, or retry once running jobs have ended"
    )


def _size(n: int) -> str:
    """Bytes for a person: `60.0 MiB (62914560 bytes)`."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"
