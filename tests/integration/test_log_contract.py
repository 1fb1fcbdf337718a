"""The log's contract over every database (`database`: SQLite, and PostgreSQL in a
throwaway cluster): migrations, a whole log with restarts written as the server
writes it, then `db check`, `db rebuild`, `replay --verify`, `explain`, the
console's queries and the views; job bodies, results, files and batches; the
lease; `db copy` from one database to the other and back. The event store's own
contract is tests/integration/test_event_store.py (the same backends)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import event as sa_event
from sqlalchemy import select, text

from app.core import events as ev
from app.report.explain import explain
from app.store import commands, console_queries, migrate
from app.store.batches import create_batch, line_summary
from app.store.engine import DatabaseError, open_database, open_readonly
from app.store.event_store import read_events
from app.store.explain_queries import last_dispatches
from app.store.files import file_content, file_row, list_files, store_file
from app.store.job_bodies import load_body, store_body
from app.store.job_results import job_result, store_result
from app.store.lease import Holder, LeaseHeld, acquire, fence
from app.store.queries import activity, open_enqueues
from app.store.samples import recent_samples
from app.store.tables import metadata
from tests.integration.test_explain_replay import simulated_log
from tools.replay.cli import replay_command
from tools.replay.generate import write_log


@pytest.fixture(scope="module")
def log() -> list[ev.AnyEvent]:
    """A simulated server's log: durable jobs, swaps, cancellations, three restarts."""
    return simulated_log(seed=1, log_format=2, requests=120)


def rows(db: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every table's rows, in primary-key order, as SQLAlchemy reads them (booleans
    as bool, JSON decoded), so two databases compare."""
    engine = open_database(db, upgrade=False)
    try:
        with engine.connect() as conn:
            return {
                table.name: [
                    tuple(row)
                    for row in conn.execute(select(table).order_by(*table.primary_key.columns))
                ]
                for table in metadata.sorted_tables
            }
    finally:
        engine.dispose()


def test_migrations_run_up_and_down_and_match_the_tables(database: str) -> None:
    engine = open_database(database)
    with engine.connect() as conn:
        assert migrate.current_revision(conn) == migrate.head_revision()
        assert migrate.schema_differences(conn) == []
    migrate.downgrade_to_base(engine)
    with engine.connect() as conn:
        assert set(sqlalchemy.inspect(conn).get_table_names()) == {"alembic_version"}
    migrate.upgrade_to_head(engine)
    with engine.connect() as conn:
        assert migrate.schema_differences(conn) == []
        # Integers are 64-bit on both: a priority of 2**62 is stored as it is.
        conn.execute(
            text(
                "INSERT INTO requests (id, endpoint, priority, band, status, durable, attempt, "
                "enqueue_seq, enqueued_at) VALUES ('r', '/v1', :p, 'interactive', 'queued', "
                "TRUE, 1, :p, 0.5)"
            ),
            {"p": 2**62},
        )
        assert conn.execute(text("SELECT priority FROM requests")).scalar() == 2**62
    engine.dispose()


def test_a_log_written_as_the_server_writes_checks_rebuilds_and_verifies(
    database: str, log: list[ev.AnyEvent], capsys: pytest.CaptureFixture[str]
) -> None:
    write_log(database, log)
    assert commands.check(database) == 0
    assert capsys.readouterr().out.startswith(f"ok: {len(log)} events")
    before = rows(database)
    assert commands.rebuild(database) == 0
    assert rows(database) == before  # the live projection and the rebuilt one agree
    capsys.readouterr()
    assert replay_command(["--verify", database]) == 0
    assert "decisions in" in capsys.readouterr().out


def test_job_bodies_results_files_and_batches(database: str) -> None:
    engine = open_database(database)
    body = bytes(range(256)) * 20_000  # 5 MB, every byte value
    store_body(engine, "job-1", body)
    assert load_body(engine, "job-1", size=len(body)) == body
    store_result(engine, "job-1", 200, [("content-type", "application/json")], b'{"ok":1}\x00')
    store_result(engine, "job-1", 201, [("x", "y")], b"again")  # a re-run overwrites
    assert job_result(engine, "job-1") == (201, [["x", "y"]], b"again")
    first = file_row("alice", "batch", "in.jsonl", b"line\n" * 3)
    store_file(engine, first)
    store_file(engine, file_row("bob", "batch", "other.jsonl", b"x"))
    found = file_content(engine, first["id"])
    assert found is not None and found[1] == b"line\n" * 3
    page, more = list_files(engine, "alice", None, 10, None, newest_first=True)
    assert [r["id"] for r in page] == [first["id"]] and not more
    batch = {
        "id": "batch_1",
        "caller": "alice",
        "endpoint": "/v1/chat/completions",
        "input_file_id": first["id"],
        "completion_window": "24h",
        "metadata": {"k": "v"},
        "priority": -100,
        "status": "in_progress",
        "total": 2,
        "created_at": 1.0,
        "expires_at": 2.0,
    }
    lines = [
        {"batch_id": "batch_1", "line": 1, "custom_id": "a", "model": "m", "request_id": "b-1"},
        {"batch_id": "batch_1", "line": 2, "custom_id": "b", "model": None, "request_id": None,
         "error": {"message": "no such model"}},
    ]  # fmt: skip
    create_batch(engine, batch, lines, [("b-1", b"{}")])
    assert line_summary(engine, "batch_1")["total"] == 2
    assert load_body(engine, "b-1") == b"{}"
    engine.dispose()


def test_a_second_server_on_a_live_lease_is_refused(database: str) -> None:
    engine = open_database(database)
    first = Holder(pid=1, host="elsewhere", listen="a:1", name="first")
    assert acquire(engine, first, 100.0).term == 1
    with pytest.raises(LeaseHeld, match="another gpulane serves this database"):
        acquire(engine, Holder(pid=2, host="elsewhere", listen="b:2", name="second"), 101.0)
    assert acquire(engine, first, 200.0).term == 2  # once it lapsed
    engine.dispose()


# -- the same answers on both -------------------------------------------------------------


def _close(a: Any, b: Any) -> bool:
    """Equal, with floats equal to the last bits (SQLite's REAL and PostgreSQL's
    double precision round the same IEEE doubles; SQL arithmetic may differ last)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-9)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.mark.postgres
def test_postgres_answers_every_reader_as_sqlite_does(
    tmp_path: Path, postgres_url: str, log: list[ev.AnyEvent]
) -> None:
    dbs = {"sqlite": str(tmp_path / "gpulane.db"), "postgres": postgres_url}
    answers: dict[str, dict[str, Any]] = {}
    for name, db in dbs.items():
        write_log(db, log)
        engine = open_database(db, upgrade=False)
        with engine.connect() as conn:
            ids = [r[0] for r in conn.execute(text("SELECT id FROM requests ORDER BY id"))]
            views = {
                view: [
                    tuple(r)
                    for r in conn.execute(text(f"SELECT * FROM {view} ORDER BY 1, 2, 3"))  # noqa: S608
                ]
                for view in ("request_times", "gpu_timeline", "decisions")
            }
            # wait_causes reads the clock for open requests; the finished ones are fixed.
            views["wait_causes"] = [
                tuple(r)
                for r in conn.execute(
                    text(
                        "SELECT * FROM wait_causes WHERE request_id IN "
                        "(SELECT id FROM requests WHERE finished_at IS NOT NULL) ORDER BY 1"
                    )
                )
            ]
        span = console_queries.log_span(engine)
        assert span is not None
        answers[name] = {
            "explain": [explain(engine, rid) for rid in ids],
            "views": views,
            "timeline": console_queries.timeline_requests(engine, *span, None, 1000),
            "swaps": console_queries.timeline_swaps(engine, *span, 1000),
            "finished": console_queries.finished_requests(engine, *span, limit=500),
            "waits": console_queries.wait_samples(engine, *span),
            "events": console_queries.request_events(engine, ids[0]),
            "models": console_queries.models_in_log(engine),
            "activity": activity(engine, 500, 0),
            "open": [(tuple(row), data) for row, data in open_enqueues(engine)],
            "samples": recent_samples(engine, 50, 50),
        }
        engine.dispose()
    sqlite, postgres = answers["sqlite"], answers["postgres"]
    assert sqlite["explain"] and all(x is not None and x.replay_matches for x in sqlite["explain"])
    assert len(sqlite["views"]["decisions"]) > 50
    # Requests that finished at the same instant come in one order on both (the
    # log has such ties): newest first, then by id, so pages never skip or repeat.
    for name, answer in answers.items():
        keys = [(r["finished_at"], r["id"]) for r in answer["finished"][0]]
        assert len(set(k[0] for k in keys)) < len(keys), "the log has no tie to order"
        assert keys == sorted(keys, reverse=True), name
    for key in sqlite:
        assert _close(sqlite[key], postgres[key]), key


@pytest.mark.postgres
def test_db_copy_sqlite_to_postgres_and_back_is_the_same_log(
    tmp_path: Path, postgres_url: str, log: list[ev.AnyEvent], capsys: pytest.CaptureFixture[str]
) -> None:
    source, back = str(tmp_path / "source.db"), str(tmp_path / "back.db")
    write_log(source, log)
    engine = open_database(source)
    store_body(engine, "job-x", b"\x00body\xff")
    store_result(engine, "job-x", 200, [("a", "b")], b"result")
    store_file(engine, file_row(None, "batch", "f.jsonl", b"{}\n"))
    acquire(engine, Holder(pid=1, host="h", listen="l:1", name="n"), 100.0)
    engine.dispose()

    assert commands.copy(source, postgres_url) == 0
    assert f"{len(log)} events (last seq {len(log)})" in capsys.readouterr().out
    assert commands.copy(postgres_url, back) == 0
    original = rows(source)
    assert original["server_lease"][0][-1] > original["server_lease"][0][-2]  # live
    copied = rows(postgres_url)
    assert copied["server_lease"][0][-1] == copied["server_lease"][0][-2]  # released
    for table in ("server_lease",):
        original.pop(table), copied.pop(table)
    assert _close(copied, original)
    returned = rows(back)
    returned.pop("server_lease")
    assert returned == original

    verdicts = []
    for db in (source, postgres_url, back):
        capsys.readouterr()
        assert commands.check(db) == 0
        assert replay_command(["--verify", db]) == 0
        verdicts.append(capsys.readouterr().out.splitlines()[-1])
    assert verdicts[0] == verdicts[1] == verdicts[2] and verdicts[0].startswith("ok: ")

    # Into a database that holds a log already: refused, nothing written.
    assert commands.copy(back, postgres_url) == 1
    assert "holds a log already" in capsys.readouterr().err
    assert commands.copy(source, source) == 1


# -- databases gpulane cannot use ----------------------------------------------------------


@pytest.mark.postgres
def test_an_unusable_postgresql_gives_a_database_error_naming_it_without_its_password(
    postgres_url: str,
) -> None:
    base, query = postgres_url.split("?")
    missing = base.replace("gpulane@", "gpulane:s3cret@").rsplit("/", 1)[0] + "/nowhere?" + query
    with pytest.raises(DatabaseError) as info:
        open_database(missing)
    assert "s3cret" not in str(info.value) and "***" in str(info.value)
    assert "nowhere" in str(info.value) and "does not exist" in str(info.value)

    engine = sqlalchemy.create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE invoices (id integer PRIMARY KEY, total real)"))
    engine.dispose()
    with pytest.raises(DatabaseError, match="not a gpulane database .* invoices"):
        open_database(postgres_url)


def test_a_url_of_another_database_is_refused_naming_what_is_supported(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert commands.check("mysql://u:pw@host/db") == 1
    err = capsys.readouterr().err
    assert "not mysql" in err and "postgresql+psycopg://" in err and "pw" not in err


def test_the_last_dispatch_to_each_peer_per_choice(database: str) -> None:
    """What a peer's affinity reads (SQLite's bare column beside max(), PostgreSQL's
    DISTINCT ON): the last dispatch per model and choice, in seq order."""
    sent = [("m@a", "m"), ("m@b", "m"), ("m@a", "m"), ("m@a", None), ("n", None), ("m@b", "m")]
    write_log(
        database,
        [
            ev.RequestDispatched(at=i, request_id=f"r{i}", model=model, choice=choice)
            for i, (model, choice) in enumerate(sent, start=1)
        ],
    )
    engine = open_database(database, upgrade=False)
    with engine.connect() as conn:
        found = [e.seq for e in last_dispatches(conn, 1, 7, {"m@a", "m@b"})]
        bounded = [e.seq for e in last_dispatches(conn, 1, 6, {"m@a", "m@b"})]
    engine.dispose()
    assert found == [3, 4, 6]
    assert bounded == [2, 3, 4]


def test_a_read_only_open_reads_the_log_and_cannot_write(
    database: str, log: list[ev.AnyEvent]
) -> None:
    """What `replay` and `gpulane ui --db` open: their input is never modified."""
    write_log(database, log[:50])
    engine = open_readonly(database)
    try:
        assert [seq for seq, _ in read_events(engine)] == list(range(1, 51))
        refused = pytest.raises(sqlalchemy.exc.DBAPIError, match="(?i)read-?only")
        with refused, engine.begin() as conn:
            conn.execute(text("DELETE FROM events"))
    finally:
        engine.dispose()
    assert len(rows(database)["events"]) == 50


def test_sql_run_as_it_is_takes_sqlite3_placeholders_on_both(database: str) -> None:
    """`exec_driver_sql` with `?` and `:name`, as the store's hand-written SQL is."""
    write_log(database, [enqueued_event("a"), enqueued_event("b")])
    engine = open_database(database, upgrade=False)
    with engine.connect() as conn:
        found = conn.exec_driver_sql(
            "SELECT count(*) FROM events WHERE seq > ? AND type LIKE '%enqueue%'", (1,)
        ).scalar()
        named = conn.exec_driver_sql(
            "SELECT request_id FROM events WHERE seq = :seq AND data LIKE '%' || :id || '%'",
            {"seq": 2, "id": "b"},
        ).scalar()
        plain = conn.exec_driver_sql("SELECT '100%' || 'done'").scalar()
    engine.dispose()
    assert (found, named, plain) == (1, "b", "100%done")


def enqueued_event(rid: str) -> ev.RequestEnqueued:
    return ev.RequestEnqueued(
        at=1, request_id=rid, model="m", model_requested="m", endpoint="/v1", priority=0,
        band="normal",
    )  # fmt: skip


def test_a_take_over_waits_for_a_writer_between_its_fence_and_its_commit(database: str) -> None:
    """The lease's writes take the writer's lock (BEGIN IMMEDIATE, PostgreSQL's
    LOCK TABLE events), so a take-over cannot commit between a writer's fence and
    its commit: the fence holds until the writer's events are in."""
    engine = open_database(database)
    lease = acquire(engine, Holder(pid=1, host="elsewhere", listen="a:1", name="a"), 100.0, ttl=1)
    contender = open_database(database)

    @sa_event.listens_for(contender, "connect")
    def _wait_briefly(dbapi_connection: Any, _record: Any) -> None:
        if contender.dialect.name == "sqlite":
            dbapi_connection.execute("PRAGMA busy_timeout = 200")
        else:
            dbapi_connection.autocommit = True
            dbapi_connection.execute("SET lock_timeout = 200")
            dbapi_connection.autocommit = False

    contender.dispose()  # new connections, with the short wait
    taker = Holder(pid=2, host="elsewhere", listen="b:2", name="b")
    with engine.connect() as writer:
        writer.execution_options(sqlite_begin="IMMEDIATE")
        with writer.begin():
            fence(lease.term, writer)  # still ours: the writer goes on
            with pytest.raises(DatabaseError, match="(?i)lock"):
                acquire(contender, taker, 200.0)  # expired, but the writer holds the lock
    assert acquire(contender, taker, 200.0).term == lease.term + 1  # once it committed
    contender.dispose()
    engine.dispose()
