"""A new user's first hour, from a fresh clone (issue 39): the example config
serves what `make llama` built wherever `GPULANE_CACHE` puts it, `gpulane serve`
and a reload warn of a model whose program is missing, and the reload's log
line names each model and why it restarts. Real processes."""

from __future__ import annotations

import concurrent.futures as cf
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.e2e.gateway import REPO, Gateway, fake_model, free_port_block
from tests.e2e.test_reload import config, port_of, reloads
from tests.e2e.test_serve_admin import chat, wait_until

EXAMPLE = REPO / "config.example.yaml"


def fake_llama_server(cache: Path) -> Path:
    """`<cache>/bin/llama-server`: tools.fake_upstream, started as the example
    config starts llama-server (`--port N -m MODEL ...`)."""
    server = cache / "bin" / "llama-server"
    server.parent.mkdir(parents=True)
    server.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        "port = sys.argv[sys.argv.index('--port') + 1]\n"
        f"env = {{**os.environ, 'PYTHONPATH': {str(REPO)!r}}}\n"
        "argv = [sys.executable, '-m', 'tools.fake_upstream', '--port', port, '--name', 'cached']\n"
        "os.execve(sys.executable, argv, env)\n"
    )
    server.chmod(0o755)
    return server


def example_gateway(tmp: Path, cache: Path) -> Gateway:
    text = EXAMPLE.read_text().replace("startPort: 5800", f"startPort: {free_port_block()}")
    gw = Gateway(tmp, text)
    gw.env = {"GPULANE_CACHE": str(cache)}
    return gw


def test_the_example_config_runs_the_server_built_in_gpulane_cache(tmp_path: Path) -> None:
    cache = tmp_path / "elsewhere"
    fake_llama_server(cache)
    gw = example_gateway(tmp_path, cache).start()
    try:
        with gw.client() as client:
            answer = client.post("/v1/chat/completions", json=chat("smollm2"))
            assert answer.status_code == 200, answer.text
            assert answer.json()["served_by"] == "cached"
    finally:
        gw.stop()
    assert "is not an executable file" not in gw.log.read_text()


def test_serve_and_a_reload_warn_of_a_model_whose_program_is_missing(tmp_path: Path) -> None:
    empty = tmp_path / "empty-cache"
    gw = example_gateway(tmp_path, empty).start()
    try:
        server = empty / "bin" / "llama-server"
        text = gw.log.read_text()
        for model in ("smollm2", "smollm2-long"):
            assert (
                f"WARNING gpulane: config: models.{model}.cmd: program '{server}' is not "
                f"an executable file: the first request for '{model}' will fail to start it (502)"
            ) in text
        # A reload that adds a model whose program is not on PATH says so too.
        gw.config.write_text(
            gw.config.read_text()
            + "  typo:\n    cmd: llama-sever-typo --port ${PORT}\n    checkEndpoint: none\n"
        )
        assert gw.proc is not None
        gw.proc.send_signal(signal.SIGHUP)
        reloads(gw)
        assert wait_until(
            lambda: (
                "config: models.typo.cmd: program 'llama-sever-typo' is not found on PATH"
                in gw.log.read_text()
            )
        ), gw.log.read_text()
    finally:
        gw.stop()


def test_the_reload_line_names_the_models_and_what_changed(tmp_path: Path) -> None:
    gw = Gateway(tmp_path, config(fake_model("A"), fake_model("B"))).start()
    base = port_of(gw)
    try:
        with gw.client() as client:
            assert client.post("/v1/chat/completions", json=chat("A")).status_code == 200
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
        reloads(gw)
        line = wait_until(
            lambda: re.search(r"config reloaded from .*", gw.log.read_text()), timeout=10
        )
        assert line, gw.log.read_text()
        assert line.group(0).endswith(
            ": 1 added (C), 0 removed, 1 to restart once idle (A: cmd changed)"
        ), line.group(0)
    finally:
        gw.stop()


def test_every_proxied_answer_says_its_time_to_start_its_own_load_included(
    tmp_path: Path,
) -> None:
    # A answers its health check 1.5 s after it starts: the first request's load.
    gw = Gateway(tmp_path, config(fake_model("A", "--start-delay 1.5"))).start()
    try:
        with gw.client() as client:
            cold = client.post("/v1/chat/completions", json=chat("A"))
            warm = client.post("/v1/chat/completions", json={**chat("A"), "stream": True})
        for answer in (cold, warm):
            assert answer.status_code == 200, answer.text
            rows = gw.wait_for(
                "SELECT enqueued_at, started_at, queue_wait_ms FROM requests "
                "WHERE id = ? AND started_at IS NOT NULL",
                answer.headers["x-request-id"],
            )
            # The one definition (app/core/wait.py): arrival to request_started.
            arrival_to_start_ms = (rows[0]["started_at"] - rows[0]["enqueued_at"]) * 1000
            to_start = float(answer.headers["x-gpulane-time-to-start-ms"])
            assert abs(to_start - arrival_to_start_ms) < 1
            assert to_start >= float(answer.headers["x-gpulane-queue-wait-ms"])
        # Its wait was nothing (dispatched at once), its start 1.5 s later.
        assert float(cold.headers["x-gpulane-queue-wait-ms"]) < 1000
        assert float(cold.headers["x-gpulane-time-to-start-ms"]) >= 1500
        assert float(warm.headers["x-gpulane-time-to-start-ms"]) < 1000
    finally:
        gw.stop()


def test_a_job_past_every_run_of_its_model_has_an_open_end_everywhere_it_is_shown(
    tmp_path: Path,
) -> None:
    gw = Gateway(tmp_path, "maxQueued: 1\n" + config(fake_model("A"))).start()
    hold = tmp_path / "release"
    try:
        with gw.client() as client, cf.ThreadPoolExecutor(2) as pool:
            # A's history: one run of about 0.2 s.
            assert client.post("/v1/chat/completions", json=chat("A", delay=0.2)).is_success
            held = pool.submit(
                client.post, "/v1/chat/completions", json=chat("A", hold_file=str(hold))
            )
            # Once it has run longer than that, its end is not known: it says so.
            view = wait_until(
                lambda: (
                    (v := client.get("/api/queue").json())["running"]
                    and v["running"][0]["expected_end_open"]
                    and v
                )
            )
            assert view, client.get("/api/queue").text
            behind = pool.submit(client.post, "/v1/chat/completions", json=chat("A"))
            view = wait_until(lambda: (v := client.get("/api/queue").json())["waiting"] and v)
            (waiting,) = view["waiting"]
            assert waiting["estimated_start_open"] is True
            # A refusal's Retry-After is the work known to be left, and says so.
            refused = client.post("/v1/chat/completions", json=chat("A"))
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"  # the waiting one's 0.2 s run
            assert "retry after at least 1 s (the work known to be left" in refused.text
            shown = subprocess.run(
                [sys.executable, "-m", "app.cli", "queue", "--url", gw.url],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert "end unknown: longer than any run of its model" in shown.stdout, shown
            assert ">=" in shown.stdout
            hold.touch()
            assert held.result(timeout=30).status_code == 200
            assert behind.result(timeout=30).status_code == 200
    finally:
        hold.touch()
        gw.stop()
