"""The chain queries (app/store/chains.py) on a real SQLite log: each enqueue
naming a chain read once, and a shot's place in its own chain only."""

from __future__ import annotations

from pathlib import Path

from app.core import events as ev
from app.store.chains import chain_enqueues, chain_place
from app.store.engine import open_database
from tools.replay.generate import write_log

T = 1_767_225_600 * 10**9


def enqueued(rid: str, chain: str | None, caller: str | None = "alice", **kw: int) -> ev.AnyEvent:
    return ev.RequestEnqueued(
        at=T + len(rid),
        request_id=rid,
        model="video",
        model_requested="video",
        endpoint="/v1/chat/completions",
        priority=-100,
        band="batch",
        caller=caller,
        chain=chain,
        chain_length=kw.get("length"),
    )


def test_each_enqueue_naming_a_chain_is_read_once(tmp_path: Path) -> None:
    db = tmp_path / "log.db"
    first = [enqueued("a0", "filmX1"), enqueued("a1", "film_1", length=3), enqueued("x", None)]
    write_log(db, [*first, enqueued("a2", "film_1")])
    engine = open_database(str(db))
    try:
        found, last = chain_enqueues(engine, 0)
        assert [(e.request_id, e.chain, e.chain_length) for e in found] == [
            ("a0", "filmX1", None),
            ("a1", "film_1", 3),
            ("a2", "film_1", None),
        ]
        assert chain_enqueues(engine, last) == ([], last)  # nothing new: nothing read
        write_log(db, [enqueued("b1", "film_1", caller="bob"), enqueued("a3", "filmX1")])
        more, after = chain_enqueues(engine, last)
        assert [(e.request_id, e.caller) for e in more] == [("b1", "bob"), ("a3", "alice")]
        assert after > last
        with engine.connect() as conn:
            # `_` is a LIKE wildcard: filmX1 matches the pattern, and is not film_1.
            assert chain_place(conn, "alice", "film_1", "a2") == (2, 3)
            assert chain_place(conn, "bob", "film_1", "b1") == (1, None)
            assert chain_place(conn, "alice", "filmX1", "a3") == (2, None)
            assert chain_place(conn, "alice", "film_1", "b1") == (0, 3)
    finally:
        engine.dispose()
