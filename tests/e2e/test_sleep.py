"""Sleep and wake as swap actions (issue 43), through `gpulane serve` in front of
fake vLLM and SGLang servers (tools/fake_sleeper.py) that sleep as the real ones
do: an eviction puts a server to sleep and keeps its process, a load wakes it; a
sleep that fails, a wake that hangs and a full host-memory budget fall back to a
stop and a cold start, each recorded."""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.gateway import Gateway, poll
from tests.e2e.test_lane import assert_log_sound

Start = Callable[[str], Gateway]


def sleeper(name: str, log: Path, *flags: str, sleep: str = "vllm", ttl: int = 0) -> str:
    kind = "sglang" if "sglang" in sleep else "vllm"
    return textwrap.indent(
        textwrap.dedent(f"""\
        {name}:
          cmd: >-
            {sys.executable} -m tools.fake_sleeper --port ${{PORT}} --name {name}
            --kind {kind} --log {log} {" ".join(flags)}
          sleep: {sleep}
          ttl: {ttl}
        """),
        "  ",
    )


def config(tmp: Path, a: str = "", b: str = "", extra: str = "", **kw: Any) -> str:
    return (
        f"{extra}models:\n"
        + sleeper("A", tmp / "A.jsonl", *a.split(), sleep=kw.get("sleep_a", "vllm"))
        + sleeper("B", tmp / "B.jsonl", *b.split(), sleep=kw.get("sleep_b", "vllm"))
    )


def chat(client: httpx.Client, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return client.post("/v1/chat/completions", json=body)


def fake_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def events(gw: Gateway, *types: str) -> list[tuple[str, dict[str, Any]]]:
    marks = ",".join("?" * len(types))
    rows = gw.sql(f"SELECT type, data FROM events WHERE type IN ({marks}) ORDER BY seq", *types)
    return [(r["type"], json.loads(r["data"])) for r in rows]


SWAP_EVENTS = (
    "process_started",
    "process_sleeping",
    "process_slept",
    "process_woken",
    "sleep_skipped",
    "process_stopping",
    "process_stopped",
    "swap_finished",
)


def story(gw: Gateway) -> list[str]:
    """The swap events in order, as `type model` (and a stop's reason)."""
    out = []
    for kind, data in events(gw, *SWAP_EVENTS):
        extra = f" {data['reason']}" if "reason" in data else ""
        extra += f" {data['action']}" if "action" in data else ""
        out.append(f"{kind} {data['model']}{extra}")
    return out


def test_eviction_sleeps_and_a_load_wakes_the_same_process(gateway: Start, tmp_path: Path) -> None:
    gw = gateway(config(tmp_path, "--sleep-time 0.2 --wake-time 0.3"))
    with gw.client() as client:
        assert chat(client, "A").status_code == 200
        assert chat(client, "B").status_code == 200
        running = {r["model"]: r for r in client.get("/running").json()["running"]}
        assert running["A"]["state"] == "sleeping" and running["B"]["state"] == "ready"
        listed = {m["id"]: m["state"] for m in client.get("/v1/models").json()["data"]}
        assert listed == {"A": "sleeping", "B": "ready"}
        assert chat(client, "A").status_code == 200
    a_log = fake_log(tmp_path / "A.jsonl")
    assert [e["ev"] for e in a_log] == ["start", "sleep", "wake"]  # one process, no cold start
    gw.wait_for("SELECT 1 FROM events WHERE type = 'swap_finished'", count=3)
    assert story(gw) == [
        "process_started A",
        "swap_finished A",
        "process_sleeping A",
        "process_slept A",
        "process_started B",
        "swap_finished B",
        "process_sleeping B",
        "process_slept B",
        "process_woken A",
        "swap_finished A",
    ]
    woken = events(gw, "process_woken")[0][1]
    assert woken["pid"] == a_log[0]["pid"] and woken["duration_ms"] >= 300
    slept = events(gw, "process_slept")[0][1]
    assert slept["duration_ms"] >= 200
    assert_log_sound(gw)
    # explain tells the third request's swap as it was: a wake, B put to sleep.
    third = gw.sql("SELECT id FROM requests ORDER BY enqueued_at")[2]["id"]
    told = subprocess.run(
        [sys.executable, "-m", "app.cli", "explain", third, "--db", str(gw.db)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "woke A in " in told, told
    assert "a cold start of B costs " in told and "it was put to sleep instead" in told, told
    verified = subprocess.run(
        [sys.executable, "-m", "tools.replay", str(gw.db), "--verify"],
        capture_output=True,
        text=True,
    )
    assert verified.returncode == 0 and verified.stdout.startswith("ok: "), verified.stdout


def test_sglang_releases_and_resumes_memory(gateway: Start, tmp_path: Path) -> None:
    gw = gateway(config(tmp_path, sleep_a="sglang", sleep_b="sglang"))
    with gw.client() as client:
        for model in ("A", "B", "A"):
            assert chat(client, model).status_code == 200
    assert [e["ev"] for e in fake_log(tmp_path / "A.jsonl")] == ["start", "sleep", "wake"]
    assert [e["ev"] for e in fake_log(tmp_path / "B.jsonl")] == ["start", "sleep"]
    assert_log_sound(gw)


def test_a_sleep_that_fails_is_a_stop_and_the_next_load_a_cold_start(
    gateway: Start, tmp_path: Path
) -> None:
    gw = gateway(config(tmp_path, "--sleep-fails"))
    with gw.client() as client:
        for model in ("A", "B", "A"):
            assert chat(client, model).status_code == 200
    a_log = [e["ev"] for e in fake_log(tmp_path / "A.jsonl")]
    assert a_log == ["start", "sleep_failed", "exit", "start"]  # stopped, then cold-started
    gw.wait_for("SELECT 1 FROM events WHERE type = 'swap_finished'", count=3)
    assert story(gw)[:7] == [
        "process_started A",
        "swap_finished A",
        "process_sleeping A",
        "sleep_skipped A sleep",
        "process_stopping A evicted",
        "process_stopped A evicted",
        "process_started B",
    ]
    skipped = events(gw, "sleep_skipped")[0][1]
    assert "POST /sleep?level=1 answered 500" in skipped["why"]
    assert_log_sound(gw)


def test_a_wake_that_hangs_is_bounded_then_a_cold_start(gateway: Start, tmp_path: Path) -> None:
    gw = gateway(config(tmp_path, "--wake-hangs", sleep_a="{preset: vllm, wakeTimeout: 1}"))
    with gw.client() as client:
        for model in ("A", "B", "A"):
            assert chat(client, model).status_code == 200
    a_log = [e["ev"] for e in fake_log(tmp_path / "A.jsonl")]
    assert a_log == ["start", "sleep", "wake_hung", "exit", "start"]
    gw.wait_for("SELECT 1 FROM events WHERE type = 'swap_finished'", count=3)
    assert story(gw)[-6:] == [
        "process_slept B",
        "sleep_skipped A wake",
        "process_stopping A wake_failed",
        "process_stopped A wake_failed",
        "process_started A",
        "swap_finished A",
    ]
    skipped = events(gw, "sleep_skipped")[0][1]
    assert skipped["why"] == "the wake took more than its 1 s" and skipped["duration_ms"] >= 1000
    assert_log_sound(gw)


def test_past_the_host_memory_budget_a_model_is_stopped_instead(
    gateway: Start, tmp_path: Path
) -> None:
    budget = "sleepHostMemory: 10GiB\n"
    gw = gateway(
        config(
            tmp_path,
            extra=budget,
            sleep_a="{preset: vllm, hostMemory: 16GiB}",
            sleep_b="{preset: vllm, hostMemory: 8GiB}",
        )
    )
    with gw.client() as client:
        for model in ("A", "B", "A"):
            assert chat(client, model).status_code == 200
    # A (16 GiB) never fits: stopped, then cold-started; B (8 GiB) sleeps.
    assert [e["ev"] for e in fake_log(tmp_path / "A.jsonl")] == ["start", "exit", "start"]
    assert [e["ev"] for e in fake_log(tmp_path / "B.jsonl")] == ["start", "sleep"]
    skipped = events(gw, "sleep_skipped")[0][1]
    assert skipped["why"] == "its hostMemory 16.0 GiB is more than sleepHostMemory 10.0 GiB"
    assert_log_sound(gw)


def test_a_sleepers_ttl_and_an_unload_stop_it(gateway: Start, tmp_path: Path) -> None:
    text = (
        "models:\n" + sleeper("A", tmp_path / "A.jsonl", ttl=1) + sleeper("B", tmp_path / "B.jsonl")
    )
    gw = gateway(text)
    with gw.client() as client:
        assert chat(client, "A").status_code == 200
        assert chat(client, "B").status_code == 200
        # A sleeps, and its TTL (1 s from its last use) stops it.
        poll(lambda: "exit" in [e["ev"] for e in fake_log(tmp_path / "A.jsonl")], "A's TTL stop")
        assert chat(client, "A").status_code == 200  # B sleeps now (no TTL)
        poll(lambda: client.get("/running").json()["running"], "the running list")
        assert client.post("/api/models/unload/B").status_code == 200
        b_log = [e["ev"] for e in fake_log(tmp_path / "B.jsonl")]
        assert b_log == ["start", "sleep", "exit"]
    gw.wait_for("SELECT 1 FROM events WHERE type = 'process_stopped'", count=2)
    reasons = [d["reason"] for _, d in events(gw, "process_stopped")]
    assert reasons == ["ttl", "unload"]
    assert_log_sound(gw)


def test_a_reload_that_changes_a_sleeping_model_stops_it(gateway: Start, tmp_path: Path) -> None:
    gw = gateway(config(tmp_path))
    with gw.client() as client:
        assert chat(client, "A").status_code == 200
        assert chat(client, "B").status_code == 200  # A sleeps
        start_port = gw.config.read_text().splitlines()[0]
        gw.config.write_text(start_port + "\n" + config(tmp_path, a="--sleep-time 0.01"))
        assert gw.proc is not None
        gw.proc.send_signal(signal.SIGHUP)
        poll(lambda: events(gw, "config_reloaded"), "the reload")
        assert events(gw, "config_reloaded")[0][1]["restarted"] == ["A"]
        poll(lambda: events(gw, "process_stopped"), "A's stop")
        assert chat(client, "A").status_code == 200  # its new command, cold-started
    assert [e["ev"] for e in fake_log(tmp_path / "A.jsonl")] == ["start", "sleep", "exit", "start"]
    assert [d["reason"] for _, d in events(gw, "process_stopped")] == ["reload"]
    assert_log_sound(gw)


def test_to_make_room_the_longest_asleep_is_stopped(gateway: Start, tmp_path: Path) -> None:
    each = "{preset: vllm, hostMemory: 8GiB}"
    text = "sleepHostMemory: 10GiB\nmodels:\n" + "".join(
        sleeper(m, tmp_path / f"{m}.jsonl", sleep=each) for m in ("A", "B", "C")
    )
    gw = gateway(text)
    with gw.client() as client:
        for model in ("A", "B", "C"):  # A sleeps; then B's sleep needs A's room
            assert chat(client, model).status_code == 200
        poll(lambda: "exit" in [e["ev"] for e in fake_log(tmp_path / "A.jsonl")], "A's stop")
        running = {r["model"]: r["state"] for r in client.get("/running").json()["running"]}
        assert running == {"B": "sleeping", "C": "ready"}
    assert [e["ev"] for e in fake_log(tmp_path / "A.jsonl")] == ["start", "sleep", "exit"]
    assert [e["ev"] for e in fake_log(tmp_path / "B.jsonl")] == ["start", "sleep"]
    gw.wait_for("SELECT 1 FROM events WHERE type = 'process_stopped'")
    assert [(d["model"], d["reason"]) for _, d in events(gw, "process_stopped")] == [
        ("A", "host_memory")
    ]
    assert_log_sound(gw)


def test_a_shutdown_during_a_sleep_stops_the_sleeper_too(gateway: Start, tmp_path: Path) -> None:
    gw = gateway(config(tmp_path, "--sleep-time 3", extra="shutdownGrace: 0\n"))
    with gw.client() as client, cf.ThreadPoolExecutor(1) as pool:
        assert chat(client, "A").status_code == 200
        pool.submit(chat, client, "B")  # evicts A: its sleep takes 3 s
        poll(lambda: events(gw, "process_sleeping"), "A's sleep to begin")
        gw.stop()  # SIGTERM while A's sleep is under way
    a_log = [e["ev"] for e in fake_log(tmp_path / "A.jsonl")]
    assert a_log[-1] == "exit", a_log  # not left asleep behind a stopped gpulane
    assert [d["reason"] for _, d in events(gw, "process_stopped") if d["model"] == "A"] == [
        "shutdown"
    ]


def unloaded_mid_sleep(
    gw: Gateway, client: httpx.Client, path: str, release: Path, asked: str
) -> httpx.Response:
    """POST `path` while A's sleep is held (until `release` exists), and let the
    sleep go only once gpulane has the unload (its log says so on arrival; the
    unload waits out the sleep, recording nothing till then): the unload lands
    in the sleep however slow the host (a sleep of a fixed 2-4 s could end first)."""
    assert not events(gw, "process_slept")  # the unload lands while A's sleep is under way
    with cf.ThreadPoolExecutor(1) as pool:
        unload = pool.submit(client.post, path)
        try:
            poll(lambda: asked in gw.log.read_text(), "gpulane to have the unload", timeout=30)
        finally:
            release.touch()
        r = unload.result(timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_an_unload_during_a_sleep_stops_the_sleeper_too(gateway: Start, tmp_path: Path) -> None:
    release = tmp_path / "release-sleep"
    gw = gateway(config(tmp_path, f"--sleep-hold-file {release}"))
    with gw.client() as client, cf.ThreadPoolExecutor(1) as pool:
        assert chat(client, "A").status_code == 200
        pool.submit(chat, client, "B")  # evicts A: its sleep lasts until released
        poll(lambda: events(gw, "process_sleeping"), "A's sleep to begin")
        unloaded_mid_sleep(gw, client, "/api/models/unload", release, "unload of every model asked")
        poll(lambda: "exit" in [e["ev"] for e in fake_log(tmp_path / "A.jsonl")], "A's stop")
        running = {r["model"]: r["state"] for r in client.get("/running").json()["running"]}
        assert "A" not in running, running  # not left asleep after an unload of every model
    gw.wait_for("SELECT 1 FROM events WHERE type = 'process_stopped'")
    assert [d["reason"] for _, d in events(gw, "process_stopped") if d["model"] == "A"] == [
        "unload"
    ]
    assert_log_sound(gw)


def test_an_unload_of_the_model_during_its_sleep_stops_the_sleeper_too(
    gateway: Start, tmp_path: Path
) -> None:
    """As above, for an unload of that one model by name: A is in neither table
    while its sleep is under way, and must not be left asleep."""
    release = tmp_path / "release-sleep"
    gw = gateway(config(tmp_path, f"--sleep-hold-file {release}"))
    with gw.client() as client, cf.ThreadPoolExecutor(1) as pool:
        assert chat(client, "A").status_code == 200
        pending = pool.submit(chat, client, "B")  # evicts A: its sleep lasts until released
        poll(lambda: events(gw, "process_sleeping"), "A's sleep to begin")
        r = unloaded_mid_sleep(gw, client, "/api/models/unload/A", release, "unload of A asked")
        assert r.text == "OK", r.text
        # The unload answers once A has stopped: nothing to wait for here.
        assert [e["ev"] for e in fake_log(tmp_path / "A.jsonl")][-1] == "exit"
        running = {r["model"]: r["state"] for r in client.get("/running").json()["running"]}
        assert "A" not in running, running  # not left asleep after its unload
        assert pending.result(timeout=30).status_code == 200  # B, untouched by A's unload
        assert [e["ev"] for e in fake_log(tmp_path / "B.jsonl")] == ["start"]
    gw.wait_for("SELECT 1 FROM events WHERE type = 'process_stopped'")
    assert [(d["model"], d["reason"]) for _, d in events(gw, "process_stopped")] == [
        ("A", "unload")
    ]
    assert_log_sound(gw)
