"""job_bodies on a real SQLite file: a body in and out unchanged, gone with its
job's terminal event (in that transaction), and pruning of what is left over."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text

from app.core import events as ev
from app.store import commands
from app.store.cursor import driver_cursor
from app.store.engine import open_database
from app.store.event_store import next_seq, write_events
from app.store.job_bodies import (
    BodyMissing,
    delete_body,
    disk_free,
    load_body,
    prune_bodies,
    store_body,
)

T0 = 1_796_000_000_000_000_000


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = open_database(tmp_path / "gpulane.db")
    yield engine
    engine.dispose()


def record(engine: Engine, *events: ev.AnyEvent) -> None:
    """Append events as the event store does: with their read models, in one transaction."""
    with engine.begin() as conn:
        cur = driver_cursor(conn)
        write_events(cur, next_seq(cur), list(events))


def enqueued(rid: str) -> ev.RequestEnqueued:
    return ev.RequestEnqueued(
        at=T0,
        request_id=rid,
        model="m",
        model_requested="m",
        endpoint="/v1/chat/completions",
        priority=0,
        band="normal",
        durable=True,
        job={"method": "POST", "path": "/v1/chat/completions", "query": "", "headers": {}},
    )


def stored(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        return {r[0] for r in conn.execute(text("SELECT request_id FROM job_bodies"))}


def test_a_body_comes_back_byte_for_byte_and_checked(engine: Engine) -> None:
    body = os.urandom(3 * 1024 * 1024 + 17)  # not a whole number of write chunks
    store_body(engine, "big", body)
    store_body(engine, "empty", b"")
    assert load_body(engine, "big") == body
    assert load_body(engine, "big", len(body)) == body
    assert load_body(engine, "empty", 0) == b""
    with pytest.raises(BodyMissing, match="has 3145745 bytes, not 12 as submitted"):
        load_body(engine, "big", 12)
    with pytest.raises(BodyMissing, match="not the one submitted"):
        load_body(engine, "big", len(body), "0" * 64)
    delete_body(engine, "big")
    with pytest.raises(BodyMissing, match="not in the database"):
        load_body(engine, "big")


@pytest.mark.parametrize(
    "end",
    [
        ev.RequestCompleted(at=T0 + 3, request_id="j", http_status=200),
        ev.RequestFailed(at=T0 + 3, request_id="j", error="swap failed"),
        ev.RequestCancelled(at=T0 + 3, request_id="j", reason="explicit"),
    ],
)
def test_a_body_is_kept_while_its_job_may_run_again_and_goes_with_its_end(
    engine: Engine, end: ev.AnyEvent
) -> None:
    store_body(engine, "j", b"{}")
    store_body(engine, "other", b"{}")
    record(engine, enqueued("j"), enqueued("other"))
    record(
        engine,
        ev.RequestDispatched(at=T0 + 1, request_id="j", model="m"),
        ev.RequestRequeued(at=T0 + 2, request_id="j", attempt=2),
    )
    assert stored(engine) == {"j", "other"}
    record(engine, end)
    assert stored(engine) == {"other"}


def test_pruning_leaves_what_a_job_or_a_pending_enqueue_needs(engine: Engine) -> None:
    for rid in ("open", "ended", "orphan", "pending"):
        store_body(engine, rid, b"body of " + rid.encode())
    record(engine, enqueued("open"), enqueued("ended"))
    record(engine, ev.RequestCancelled(at=T0 + 1, request_id="ended", reason="explicit"))
    store_body(engine, "ended", b"left behind")  # as if its end had not deleted it
    with engine.begin() as conn:
        conn.execute(text("UPDATE job_bodies SET stored_at = 0 WHERE request_id = 'orphan'"))
    # "pending" has no request yet either, but it was stored after the cut-off.
    assert prune_bodies(engine, orphans_before=time.time() - 60) == 2
    assert stored(engine) == {"open", "pending"}


def test_disk_free_is_measured_where_the_database_is(engine: Engine, tmp_path: Path) -> None:
    directory, free = disk_free(engine) or ("", 0)
    assert directory == str(tmp_path.resolve())
    stat = os.statvfs(tmp_path)
    assert abs(free - stat.f_bavail * stat.f_frsize) < 64 * 1024 * 1024
    assert disk_free(create_engine("sqlite://")) is None


def test_db_check_reports_an_open_job_whose_body_is_missing(
    engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store_body(engine, "kept", b"{}")
    record(engine, enqueued("kept"), enqueued("lost"))
    assert commands.check(str(tmp_path / "gpulane.db")) == 1
    out = capsys.readouterr().out
    assert "job lost is open but its body is missing" in out and "job kept" not in out
