"""Chains (issue 29): the headers that name one, the chains folded from the log's
enqueues, and a chain's progress by the batches' estimator."""

from __future__ import annotations

from typing import Any

import pytest

from app.core.lane_history import LaneHistory
from app.core.scoring import NS_PER_S, ScoringParams
from app.jobs.chain_index import ChainIndex
from app.jobs.chain_progress import chain_progress, producer_gap_s
from app.report.render import runs_text
from app.report.run_times import RunTimes
from app.runtime.api import LiveState
from app.store.chains import ChainEnqueue
from app.web.chain_headers import read_chain
from app.web.request_body import BadRequest
from tests.unit.core_driver import CoreDriver


def test_a_request_names_its_chain_and_may_give_its_length() -> None:
    assert read_chain({}) == (None, None)
    assert read_chain({"x-gpulane-chain": "film-1"}) == ("film-1", None)
    headers = {"x-gpulane-chain": " film_1.v2:a ", "x-gpulane-chain-length": "174"}
    assert read_chain(headers) == ("film_1.v2:a", 174)
    assert read_chain({"x-gpulane-chain": "c" * 128})[0] == "c" * 128


@pytest.mark.parametrize(
    ("headers", "named", "allowed"),
    [
        ({"x-gpulane-chain": "c" * 129}, "X-Gpulane-Chain: ", "1 to 128 characters"),
        ({"x-gpulane-chain": ""}, "X-Gpulane-Chain: ''", "1 to 128 characters"),
        ({"x-gpulane-chain": "film 1"}, "X-Gpulane-Chain: 'film 1'", "letters, digits"),
        ({"x-gpulane-chain": "a/b"}, "X-Gpulane-Chain: 'a/b'", "letters, digits"),
        ({"x-gpulane-chain": "a", "x-gpulane-chain-length": "0"}, "Chain-Length: '0'", "1 to"),
        ({"x-gpulane-chain": "a", "x-gpulane-chain-length": "-3"}, "Chain-Length: '-3'", "whole"),
        ({"x-gpulane-chain": "a", "x-gpulane-chain-length": "1.5"}, "Length: '1.5'", "whole"),
        ({"x-gpulane-chain": "a", "x-gpulane-chain-length": "ten"}, "Length: 'ten'", "whole"),
        ({"x-gpulane-chain": "a", "x-gpulane-chain-length": "1000001"}, "1000001", "1000000"),
        ({"x-gpulane-chain": "a", "x-gpulane-chain-length": "١٢"}, "Length: '١٢'", "plain"),
        ({"x-gpulane-chain-length": "3"}, "X-Gpulane-Chain-Length needs X-Gpulane-Chain", ""),
    ],
)
def test_a_bad_chain_header_is_a_400_naming_it_and_what_it_allows(
    headers: dict[str, str], named: str, allowed: str
) -> None:
    with pytest.raises(BadRequest) as caught:
        read_chain(headers)
    assert caught.value.status == 400
    assert named in caught.value.message and allowed in caught.value.message


def shot(seq: int, rid: str, chain: str = "film-1", caller: str | None = "alice", **kw: Any) -> Any:
    return ChainEnqueue(
        seq, rid, caller, chain, kw.get("length"), kw.get("model", "video"), seq * NS_PER_S
    )


def test_chains_are_per_caller_and_a_shot_keeps_its_first_place() -> None:
    index = ChainIndex()
    index.fold([shot(1, "a1", length=3), shot(2, "b1", caller="bob"), shot(3, "a2")], 3)
    index.fold([shot(5, "a1"), shot(6, "a3", model="upscale", length=4)], 7)  # a1 again: a retry
    assert index.position == 7
    alice, bob = index.chains[("alice", "film-1")], index.chains[("bob", "film-1")]
    assert alice.shots == ["a1", "a2", "a3"] and bob.shots == ["b1"]
    assert alice.length == 4 and alice.model == "upscale"  # the latest given wins
    assert bob.length is None
    found = index.of_request("a3")
    assert found is not None and found[0] is alice and found[1] == 3
    assert index.of_request("a1") == (alice, 1)
    assert index.of_request("nope") is None
    assert {c.caller for c in index.named("film-1")} == {"alice", "bob"}


TIMES = RunTimes({"video": 240.0}, {"video": 30.0}, 240.0, 30.0)


def test_a_chains_progress_counts_its_shots_and_those_still_to_come() -> None:
    d = CoreDriver(ScoringParams(), resident="video")
    index = ChainIndex()
    index.fold([shot(i, f"s{i}", length=10) for i in range(1, 6)], 5)
    d.enqueue("s4", "video", -100, caller="alice")
    d.step()
    d.enqueue("s5", "video", -100, caller="alice")
    rows = {
        "s1": {"status": "completed", "http_status": 200},
        "s2": {"status": "completed", "http_status": 500},
        "s3": {"status": "cancelled", "http_status": None},
        "s4": {"status": "running", "http_status": None},
        "s5": {"status": "queued", "http_status": None},
    }
    live = LiveState(d.state, {"s4": d.now}, d.now)
    p = chain_progress(index.chains[("alice", "film-1")], rows, live, TIMES)
    assert (p.total, p.done, p.failed, p.running, p.waiting) == (10, 1, 2, 1, 6)
    # s4's run, then s5 and the five shots not sent yet: one median run each.
    assert p.estimated_finish_in_s == 7 * 240.0
    assert p.basis is not None and p.basis.unqueued == 5


def test_a_chain_whose_length_is_unknown_counts_what_came() -> None:
    d = CoreDriver(ScoringParams(), resident="video")
    index = ChainIndex()
    index.fold([shot(1, "s1"), shot(2, "s2")], 2)
    d.enqueue("s2", "video", -100, caller="alice")
    rows = {"s1": {"status": "completed", "http_status": 200}}
    live = LiveState(d.state, {}, d.now)
    p = chain_progress(index.chains[("alice", "film-1")], rows, live, TIMES)
    assert (p.total, p.done, p.waiting) == (2, 1, 1)
    assert p.basis is not None and p.basis.unqueued == 0


def test_a_chains_estimate_forecasts_from_the_lanes_history_with_an_interval() -> None:
    d = CoreDriver(ScoringParams(), resident="video")
    index = ChainIndex()
    index.fold([shot(i, f"s{i}", length=10) for i in range(1, 3)], 2)
    d.enqueue("s2", "video", -100, caller="alice")
    # Three hours of log: interactive video a minute in every ten, a rate to go on.
    history = LaneHistory()
    history.begins(d.now - 3 * 3600 * NS_PER_S)
    for k in range(18):
        history.add_run(d.now - (3 * 3600 - k * 600) * NS_PER_S, "video", 100, 60 * NS_PER_S)
    rows = {"s1": {"status": "completed", "http_status": 200}}
    live = LiveState(d.state, {}, d.now)
    chain = index.chains[("alice", "film-1")]
    floor = chain_progress(chain, rows, live, TIMES)
    p = chain_progress(chain, rows, live, TIMES, history)
    assert floor.estimated_finish_low_at is None and floor.estimated_finish_high_at is None
    assert p.estimated_finish_at is not None and floor.estimated_finish_at is not None
    assert p.estimated_finish_low_at is not None and p.estimated_finish_high_at is not None
    assert p.estimated_finish_low_at <= p.estimated_finish_at < p.estimated_finish_high_at
    assert p.estimated_finish_at >= floor.estimated_finish_at


def test_a_chains_producer_gap_is_its_mean_from_a_shots_end_to_the_next_enqueue() -> None:
    d = CoreDriver(ScoringParams(), resident="video")
    index = ChainIndex()
    index.fold([shot(i, f"s{i}", length=6) for i in range(1, 5)], 4)
    d.enqueue("s4", "video", -100, caller="alice")
    t = d.now / NS_PER_S
    rows = {  # gaps of 10 s and 30 s; s4 was sent before s3 ended (no gap)
        "s1": {
            "status": "completed",
            "http_status": 200,
            "enqueued_at": t - 900,
            "finished_at": t - 700,
        },
        "s2": {
            "status": "completed",
            "http_status": 200,
            "enqueued_at": t - 690,
            "finished_at": t - 500,
        },
        "s3": {
            "status": "completed",
            "http_status": 200,
            "enqueued_at": t - 470,
            "finished_at": t - 1,
        },
        "s4": {"status": "queued", "http_status": None, "enqueued_at": t - 2, "finished_at": None},
    }
    assert producer_gap_s(["s1", "s2", "s3", "s4"], rows) == 20.0
    assert producer_gap_s(["s1"], rows) == 0.0
    p = chain_progress(
        index.chains[("alice", "film-1")], rows, LiveState(d.state, {}, d.now), TIMES
    )
    # s4's run, then two shots not sent yet, each after the producer's gap.
    assert p.estimated_finish_in_s == 3 * 240.0 + 2 * 20.0


def test_gpulane_queue_prints_a_line_per_chain_its_total_when_known() -> None:
    base = {"done": 3, "failed": 0, "running": 1, "waiting": 2, "basis": None}
    known = {"object": "chain", "id": "film-1", "caller": "render", "status": "in_progress"}
    unknown = known | {"id": "nightly", "caller": None}
    text = runs_text(
        [known | {"progress": base | {"total": 10}}, unknown | {"progress": base | {"total": None}}]
    )
    assert text.splitlines() == [
        "chain film-1 in_progress caller render: 3/10 done, 1 running, 2 waiting, 0 failed",
        "chain nightly in_progress: 3/? done, 1 running, 2 waiting, 0 failed",
    ]
