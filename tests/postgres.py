"""A throwaway PostgreSQL cluster for tests and benchmarks: Debian's server
binaries, its own data directory under a temp dir, a free port, its unix
socket in that directory, stopped and deleted at the end.

PostgreSQL refuses to run as root; as root the cluster runs as `nobody`,
owning its data directory. `make test` installs Debian's PostgreSQL when it is
missing (mk/postgres.mk); when it cannot be started, `Cluster.start` raises,
so the tests that need it fail loudly rather than skip (deselect them with
`-m 'not postgres'` for a fast run).

    with Cluster.started() as cluster:
        url = cluster.new_database()   # postgresql+psycopg://... of an empty database
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg

SUPERUSER = "gpulane"
RUN_AS = "nobody"
"""Who runs the server when we are root."""
START_TIMEOUT_S = 30


class PostgresUnavailable(Exception):
    """No PostgreSQL server binaries, or the cluster would not start; says why."""


def server_bin() -> Path:
    """The directory of Debian's `initdb` and `pg_ctl` (the newest version)."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    raise PostgresUnavailable(
        "PostgreSQL's server binaries (initdb, pg_ctl) are not installed: `make postgres` "
        "installs Debian's package (apt-get install postgresql)"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Cluster:
    """One running cluster; `new_database` hands out empty databases."""

    def __init__(self, root: Path, *, fsync: bool = False) -> None:
        self.root = root
        self.data = root / "data"
        self.port = _free_port()
        self.fsync = fsync
        self._bin = server_bin()

    @classmethod
    @contextlib.contextmanager
    def started(cls, *, fsync: bool = False) -> Iterator[Cluster]:
        """A started cluster, stopped and deleted when the block ends.

        `fsync=False` for tests (nothing is kept past the run); benchmarks that
        compare durable commits pass True, as SQLite's are synced too."""
        root = Path(tempfile.mkdtemp(prefix="gpulane-pg-"))
        cluster = cls(root, fsync=fsync)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()
            shutil.rmtree(root, ignore_errors=True)

    def _run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        command = [str(self._bin / argv[0]), *argv[1:]]
        if os.geteuid() == 0:
            command = ["runuser", "-u", RUN_AS, "--", *command]
        return subprocess.run(command, capture_output=True, text=True, timeout=START_TIMEOUT_S)

    def start(self) -> None:
        if os.geteuid() == 0:
            # `nobody` must reach the data directory: the temp dir is ours, mode 700.
            self.root.chmod(0o755)
            self.data.mkdir()
            shutil.chown(self.data, RUN_AS)
        done = self._run(
            "initdb", "-D", str(self.data), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8",
            "--no-sync", "--locale=C",
        )  # fmt: skip
        if done.returncode != 0:
            raise PostgresUnavailable(f"initdb failed: {done.stderr.strip() or done.stdout}")
        options = (
            f"-c listen_addresses=127.0.0.1 -c port={self.port} "
            f"-c unix_socket_directories={self.data} -c fsync={'on' if self.fsync else 'off'} "
            "-c max_connections=200"
        )
        log = self.data / "server.log"
        done = self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(log), "-o", options, "-w", "start"
        )
        if done.returncode != 0:
            text = log.read_text() if log.exists() else ""
            raise PostgresUnavailable(f"pg_ctl start failed: {done.stderr.strip()}\n{text[-2000:]}")

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def url(self, database: str = "postgres") -> str:
        """The SQLAlchemy URL of `database`, over the unix socket in the data directory."""
        return f"postgresql+psycopg://{SUPERUSER}@/{database}?host={self.data}&port={self.port}"

    def new_database(self) -> str:
        """Create an empty database; its SQLAlchemy URL."""
        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(
            host=str(self.data), port=self.port, user=SUPERUSER, dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)
