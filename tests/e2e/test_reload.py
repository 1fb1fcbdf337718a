"""A config reload as a llama-swap user meets it: SIGHUP (also what a closed
terminal sends) and `-watch-config` read the file again while `gpulane serve`
runs, keep the queue, serve added models, restart changed ones once idle, and
refuse a broken file while the running config stays. Real processes."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.e2e.gateway import REPO, Gateway, fake_model
from tests.e2e.test_serve_admin import chat, events, wait_until


def config(*models: str, start_port: int | None = None) -> str:
    """`start_port` None: the Gateway picks a free block (and writes it first)."""
    head = "" if start_port is None else f"startPort: {start_port}\n"
    return head + "models:" + "".join(m.replace("\n", "\n  ") for m in models) + "\n"


def start(tmp: Path, text: str, *args: str) -> Gateway:
    gw = Gateway(tmp, text)
    gw.args = list(args)
    return gw.start()


def port_of(gw: Gateway) -> int:
    first = gw.config.read_text().splitlines()[0]
    return int(first.split(":")[1])


def reloads(gw: Gateway, count: int = 1) -> list[dict[str, Any]]:
    return events(gw, "config_reloaded", count=count)


def test_sighup_reloads_the_config_and_keeps_the_queue(tmp_path: Path) -> None:
    gw = start(tmp_path, config(fake_model("A"), fake_model("B")))
    base = port_of(gw)
    try:
        # A runs until the reload is done: a fixed run could end first on a slow
        # host, and B run before the reload instead of waiting through it.
        release = tmp_path / "release"
        with gw.client() as client, cf.ThreadPoolExecutor(2) as pool:
            slow = pool.submit(
                client.post, "/v1/chat/completions", json=chat("A", hold_file=str(release))
            )
            assert events(gw, "request_started")
            queued = pool.submit(client.post, "/v1/chat/completions", json=chat("B"))
            assert wait_until(lambda: len(events(gw, "request_enqueued", count=2, timeout=0)) == 2)
            # A is changed (restarted once idle), B stays, C is new.
            gw.config.write_text(
                config(
                    fake_model("A", "--name A-changed"),
                    fake_model("B"),
                    fake_model("C"),
                    start_port=base,
                )
            )
            assert gw.proc is not None
            gw.proc.send_signal(signal.SIGHUP)
            try:
                (reload,) = reloads(gw)
            finally:
                release.touch()
            assert gw.proc.poll() is None  # SIGHUP no longer ends gpulane
            assert reload["added"] == ["C"] and reload["restarted"] == ["A"]
            assert slow.result(timeout=30).status_code == 200  # not stopped mid-request
            assert queued.result(timeout=30).status_code == 200  # the queue survived
            # A restarted once idle, with the new command.
            stopped = events(gw, "process_stopped")
            assert [(e["model"], e["reason"]) for e in stopped] == [("A", "reload")]
            again = client.post("/v1/chat/completions", json=chat("A"))
            assert again.status_code == 200, again.text
            assert "A-changed" in again.text
            assert client.post("/v1/chat/completions", json=chat("C")).status_code == 200
            assert "C" in [m["id"] for m in client.get("/v1/models").json()["data"]]

            # A broken file is refused: the running config stays.
            gw.config.write_text("models:\n  A:\n    cmd: [\n")
            gw.proc.send_signal(signal.SIGHUP)
            wait_until(lambda: "reload of" in gw.log.read_text())
            assert "refused, the running config stays" in gw.log.read_text()
            assert client.post("/v1/chat/completions", json=chat("C")).status_code == 200
            assert len(events(gw, "config_reloaded", timeout=0)) == 1
    finally:
        gw.stop()
    check = gw.db_check()
    assert check.returncode == 0, check.stdout + check.stderr
    verify = subprocess.run(
        [sys.executable, "-m", "app.cli", "replay", str(gw.db), "--verify"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_watch_config_reloads_when_the_file_changes(tmp_path: Path) -> None:
    gw = start(tmp_path, config(fake_model("A")), "--watch-config")
    base = port_of(gw)
    try:
        with gw.client() as client:
            assert client.post("/v1/chat/completions", json=chat("B")).status_code == 404
            gw.config.write_text(config(fake_model("A"), fake_model("B"), start_port=base))
            (reload,) = reloads(gw)
            assert reload["added"] == ["B"]
            assert client.post("/v1/chat/completions", json=chat("B")).status_code == 200
    finally:
        gw.stop()


def test_a_terminating_signal_leaves_no_upstream_running(tmp_path: Path) -> None:
    gw = start(tmp_path, config(fake_model("A")))
    with gw.client() as client:
        assert client.post("/v1/chat/completions", json=chat("A")).status_code == 200
    pid = events(gw, "process_started")[0]["pid"]
    assert gw.proc is not None
    gw.proc.send_signal(signal.SIGQUIT)
    assert gw.proc.wait(30) == 0
    stopped = events(gw, "process_stopped")
    assert [(e["model"], e["reason"]) for e in stopped] == [("A", "shutdown")]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        pass
    else:
        raise AssertionError(f"upstream {pid} outlived gpulane")


def test_the_server_log_says_what_happens_at_info(tmp_path: Path) -> None:
    gw = start(tmp_path, config(fake_model("A")))
    with gw.client() as client:
        assert client.post("/v1/chat/completions", json=chat("A")).status_code == 200
        assert client.get("/unload").text == "OK"
    gw.stop()
    text = gw.log.read_text()
    assert f"console at http://127.0.0.1:{gw.port}/ui/" in text
    assert "loading A for request" in text
    assert "A is ready (loaded in" in text
    assert "stopping A (pid" in text and ": unload" in text
    assert "gpulane stopped" in text


def test_the_server_log_names_each_swap_and_each_failed_load(tmp_path: Path) -> None:
    # Issue 32: at info, each swap (from, to, why) and each failed load.
    gw = start(
        tmp_path, config(fake_model("A"), fake_model("B"), fake_model("C", "--exit-at-start"))
    )
    with gw.client() as client:
        a = client.post("/v1/chat/completions", json=chat("A"))
        b = client.post("/v1/chat/completions", json=chat("B"))
        assert (a.status_code, b.status_code) == (200, 200)
        assert client.post("/v1/chat/completions", json=chat("C")).status_code == 502
    gw.stop()
    text = gw.log.read_text()
    assert f"loading B for request {b.headers['x-request-id']}, evicting A" in text
    assert "loading C for request" in text
    assert "WARNING gpulane.scheduler: loading C failed: upstream C: exited with code 3" in text


def test_api_keys_added_by_a_reload_apply_to_the_next_request(tmp_path: Path) -> None:
    gw = start(tmp_path, config(fake_model("A")))
    base = port_of(gw)
    try:
        with gw.client() as client:
            assert client.post("/v1/chat/completions", json=chat("A")).status_code == 200
            gw.config.write_text(
                "apiKeys: [sk-new-key]\n" + config(fake_model("A"), start_port=base)
            )
            assert gw.proc is not None
            gw.proc.send_signal(signal.SIGHUP)
            reloads(gw)
            anon = client.post("/v1/chat/completions", json=chat("A"))
            assert anon.status_code == 401, anon.text
            auth = {"Authorization": "Bearer sk-new-key"}
            keyed = client.post("/v1/chat/completions", json=chat("A"), headers=auth)
            assert keyed.status_code == 200, keyed.text
    finally:
        gw.stop()
