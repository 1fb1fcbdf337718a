"""llama-swap's command line, run as a service unit would after swapping the
binary (issue 24, item 2): `gpulane -config FILE -listen :PORT` serves, `-version`
prints, and a flag gpulane cannot honour is refused with a sentence naming it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app import __version__
from tests.e2e.gateway import REPO, fake_model, free_port, free_port_block, poll


def gpulane() -> list[str]:
    """The installed `gpulane` script when there is one, as a user runs it."""
    script = Path(sys.executable).with_name("gpulane")
    return [str(script)] if script.exists() else [sys.executable, "-m", "app.cli"]


def run(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": str(REPO)}
    return subprocess.run(
        [*gpulane(), *args], cwd=tmp, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "llama-swap.yaml"
    path.write_text(
        f"startPort: {free_port_block()}\nmodels:" + fake_model("A").replace("\n", "\n  ")
    )
    return path


class Served:
    def __init__(self, tmp: Path, *args: str) -> None:
        self.log = tmp / "gpulane.log"
        env = os.environ | {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        # cwd is the test's directory: database.path's default lands there.
        self.proc = subprocess.Popen(
            [*gpulane(), *args],
            cwd=tmp,
            env=env,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
        )

    def health(self, url: str, **client: object) -> str:
        with httpx.Client(timeout=1, **client) as http:  # type: ignore[arg-type]

            def answered() -> str | None:
                assert self.proc.poll() is None, self.log.read_text()
                try:
                    return http.get(url + "/health").text
                except httpx.HTTPError:
                    return None

            return str(poll(answered, f"/health at {url}", timeout=30))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[list[Served]]:
    started: list[Served] = []
    yield started
    for served in started:
        if served.proc.poll() is None:
            served.proc.kill()
            served.proc.wait()


def test_version_flag_prints_and_exits(tmp_path: Path) -> None:
    for flag in ("-version", "--version", "-version=true"):
        done = run(tmp_path, flag)
        assert done.returncode == 0, done.stderr
        assert __version__ in done.stdout


def test_config_and_listen_on_every_interface_serve(
    tmp_path: Path, config: Path, serve: list[Served]
) -> None:
    port = free_port()
    served = Served(tmp_path, "-config", str(config), "-listen", f":{port}")
    serve.append(served)
    assert served.health(f"http://127.0.0.1:{port}") == "OK"
    assert f"0.0.0.0:{port}" in served.log.read_text()
    assert served.stop() == 0
    assert (tmp_path / "gpulane.db").exists()


def test_config_dir_serves_the_merged_files(
    tmp_path: Path, config: Path, serve: list[Served]
) -> None:
    directory = tmp_path / "llama-swap.d"
    directory.mkdir()
    config.rename(directory / "10-models.yaml")
    (directory / "20-ttl.yaml").write_text("globalTTL: 60\n")
    done = run(tmp_path, "check-config", str(directory))
    assert done.returncode == 0, done.stderr
    port = free_port()
    served = Served(tmp_path, "-config-dir", str(directory), "-listen", f"127.0.0.1:{port}")
    serve.append(served)
    assert served.health(f"http://127.0.0.1:{port}") == "OK"
    with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["A"]
    assert served.stop() == 0


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_tls_flags_serve_https_and_watch_config_warns(
    tmp_path: Path, config: Path, serve: list[Served]
) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    port = free_port()
    served = Served(
        tmp_path,
        f"--config={config}",
        "-listen",
        f"127.0.0.1:{port}",
        "-tls-cert-file",
        str(cert),
        f"-tls-key-file={key}",
        "-watch-config",
    )
    serve.append(served)
    assert served.health(f"https://127.0.0.1:{port}", verify=False) == "OK"
    assert "-watch-config: ignored" not in served.log.read_text()  # it is honoured now
    assert served.stop() == 0


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["-config", "c.yaml", "-log-level", "debug"], "flag provided but not defined: -log-level"),
        (["-config", "c.yaml", "-config-dir", "d"], "-config and -config-dir together"),
        (["-listen", ":8080"], "at least one of -config FILE or -config-dir DIR"),
        (["-config", "c.yaml", "-tls-cert-file", "c.pem"], "both -tls-cert-file and -tls-key-file"),
        (["-config", "c.yaml", "extra"], "unexpected argument 'extra'"),
        (["-config"], "flag needs an argument: -config"),
    ],
)
def test_a_flag_gpulane_cannot_honour_is_refused_by_name(
    tmp_path: Path, args: list[str], says: str
) -> None:
    done = run(tmp_path, *args)
    assert done.returncode == 2
    assert says in done.stderr
    assert "Traceback" not in done.stderr


def test_gpulane_commands_still_parse_as_before(tmp_path: Path, config: Path) -> None:
    done = run(tmp_path, "check-config", str(config))
    assert done.returncode == 0, done.stderr
    assert "llama-swap's command line works too" in run(tmp_path, "--help").stdout
