"""`check-config --format yaml|json` prints the config as its file spells it
(issue 32): the file's keys, resolved, and it loads back as the same config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from app.config import Config, load_config, parse_config
from app.config.file_form import DERIVED, file_form
from app.config.resolved import ModelConfig, masked

ROOT = Path(__file__).resolve().parents[2]
LLAMA_SWAP = ROOT / "tests" / "fixtures" / "llama-swap"
# What the llama-swap examples read as ${env.NAME}.
ENVIRON = {**os.environ, "API_KEY_1": "sk-one", "API_KEY_2": "sk-two", "OPENROUTER_API_KEY": "k"}

# Every key gpulane reads, set to something other than its default.
EVERYTHING = """\
healthCheckTimeout: 50
logLevel: debug
logRequests: true
startPort: 7000
globalTTL: 30
unloadTimeout: 3
sendLoadingState: true
includeAliasesInList: true
maxRunTime: 1h
streamIdleTimeout: 0
shutdownGrace: 4
loadBackoff: 2
loadBackoffMax: 20
loadFailureLimit: 0
maxQueued: 50
maxQueuedPerCaller: 9
sleepHostMemory: 64GiB
macros:
  srv: /usr/bin/env python3
apiKeys:
  - sk-plain
  - key: sk-policy
    label: pro
    maxPriority: interactive+1
    defaultPriority: normal+1
    weight: 3
    maxQueued: 7
hooks: {on_startup: {preload: [a]}}
routing:
  scheduler:
    use: fifo
    settings:
      serial: {agingDivisor: 1.5, swapAffinityBonus: 5, fairShareBonus: 7, shortJobBonus: 3}
      fifo: {priority: {a: 5}}
  router:
    use: matrix
    settings:
      matrix:
        vars: {q: "qwen:7b"}
        sets:
          both: "a & q"
          either: "b | a & (q | b)"
        evict_costs: {q: 4}
database: {path: /tmp/elsewhere.db, synchronous: normal}
jobs: {resultRetention: 1d, maxAttempts: 5, minFreeDisk: 0, maxFileBytes: 1000,
       maxStoredBytesPerCaller: 9000}
server: {maxBodyBytes: 5000, allowedHosts: [gpu.example.com, .lan], allowedOrigins: ["https://chat.example.com"]}
upstream: {ignorePaths: ["^/a$", "^/b$"]}
models:
  a:
    cmd: |
      ${srv} -m http.server ${PORT}
        --arg "two words" --quote "it's"
    cmdStop: kill -TERM ${PID}
    aliases: [a1]
    env: ["X=1", "AGAIN=${PORT}"]
    checkEndpoint: none
    ttl: 10
    unloadTimeout: 6
    filters:
      stripParams: "temperature, top_p"
      setParams: {seed: 1}
      setParamsByID: {a-hot: {temperature: 1.5}}
    metadata: {port: "${PORT}", nested: {k: [1, 2]}}
    timeouts: {connect: 0, responseHeader: 5}
    capabilities: {in: [text], out: [text], tools: true, reranker: true, context: 4096}
    compat: {ignoreWebsockets: true}
    passCredentials: [authorization]
    streamIdleTimeout: 9
    sleep: {preset: vllm, level: 2, hostMemory: 20GB, timeout: 30, wakeTimeout: 9}
  b:
    cmd: server-b --port ${PORT}
    proxy: http://127.0.0.1:${PORT}/
    unlisted: true
    useModelName: real-b
    name: B
    description: the b
    sendLoadingState: false
    maxRunTime: 0
    sleep: {sleep: "POST /free", wake: "POST /load", check: "GET /state"}
  "qwen:7b":
    cmd: server-q --port ${PORT}
    sleep: sglang
"""

# Peers, and the older spelling of a group router.
GROUPS = """\
maxRunTime: 2h
streamIdleTimeout: 0
groups:
  pair: {swap: false, exclusive: false, members: [a, b]}
  kept: {persistent: true, members: [c]}
models:
  a: {cmd: "a --port ${PORT}"}
  b: {cmd: "b --port ${PORT}"}
  c: {cmd: "c --port ${PORT}"}
  d: {cmd: "d --port ${PORT}"}
peers:
  far:
    proxy: http://10.0.0.2:8080
    models: [x, y]
    apiKey: sk-peer
    filters: {setParams: {n: 1}, stripParams: [seed]}
    timeouts: {connect: 3}
    concurrencyLimit: 2
"""


def comparable(config: Config) -> dict[str, Any]:
    """The resolved config, secrets masked, without what no file key sets."""
    data = masked(config)
    for key in DERIVED[Config]:
        data.pop(key, None)
    for model in data["models"].values():
        model.pop("port")
    return data


def reloaded(config: Config, tmp_path: Path) -> Config:
    written = tmp_path / "printed.yaml"
    written.write_text(yaml.safe_dump(file_form(config), sort_keys=False))
    return load_config(written, environ={})


CONFIGS = {
    "everything": lambda: parse_config(EVERYTHING, environ={}),
    "groups": lambda: parse_config(GROUPS, environ={}),
    "config.example.yaml": lambda: load_config(ROOT / "config.example.yaml"),
    **{
        f"llama-swap {p.name}": (lambda p=p: load_config(p, environ=ENVIRON))
        for p in sorted(LLAMA_SWAP.glob("*.yaml"))
    },
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_printed_config_loads_back_as_the_same_config(name: str, tmp_path: Path) -> None:
    config = CONFIGS[name]()
    again = reloaded(config, tmp_path)
    assert again.warnings == ()  # nothing printed is unknown, ignored or odd
    assert comparable(again) == comparable(config)


def test_the_printed_config_uses_the_files_key_names() -> None:
    printed = file_form(parse_config(EVERYTHING, environ={}))
    serial = printed["routing"]["scheduler"]["settings"]["serial"]
    assert serial["agingDivisor"] == 1.5  # seconds, as the file says it
    assert printed["models"]["a"]["cmdStop"] == "kill -TERM '${PID}'"  # for the runtime
    assert printed["models"]["a"]["unloadTimeout"] == 6
    assert printed["jobs"]["resultRetention"] == 86400
    assert printed["apiKeys"][0] == "***1" and printed["apiKeys"][1]["key"] == "***2"
    peered = file_form(parse_config(GROUPS, environ={}))
    assert peered["peers"]["far"]["apiKey"] == "***"
    assert "far/x" not in peered["models"]  # a peer's models are its entry's
    text = json.dumps([printed, peered])
    for secret in ("sk-plain", "sk-policy", "sk-peer"):
        assert secret not in text
    for resolved_name in ("cmd_stop", "aging_divisor", "check_endpoint", "config_hash", "id"):
        assert f'"{resolved_name}"' not in text


def test_every_resolved_field_has_a_file_key_or_is_derived() -> None:
    # A new field must be printed under its file key by file_form (and reach
    # the round trip above), or be named in DERIVED. Listed here so adding one
    # without either fails.
    printed = {
        Config: {
            "models",
            "health_check_timeout",
            "start_port",
            "log_level",
            "log_requests",
            "api_keys",
            "preload",
            "router",
            "send_loading_state",
            "peers",
            "include_aliases_in_list",
            "scheduler",
            "aging_divisor",
            "swap_affinity_bonus",
            "database_path",
            "fair_share_bonus",
            "short_job_bonus",
            "tier_span",
            "max_queued",
            "max_queued_per_caller",
            "database_synchronous",
            "database_lease_s",
            "result_retention_s",
            "max_attempts",
            "min_free_disk",
            "max_file_bytes",
            "max_stored_bytes_per_caller",
            "max_video_bytes",
            "video_dir",
            "max_body_bytes",
            "allowed_hosts",
            "allowed_origins",
            "ignore_paths",
            "shutdown_grace",
            "load_backoff",
            "load_backoff_max",
            "memory_release_wait",
            "load_failure_limit",
            "sleep_host_memory",
        },
        ModelConfig: {
            "cmd",
            "cmd_stop",
            "proxy",
            "aliases",
            "env",
            "check_endpoint",
            "ttl",
            "unload_timeout",
            "unlisted",
            "use_model_name",
            "name",
            "description",
            "strip_params",
            "set_params",
            "set_params_by_id",
            "concurrency_limit",
            "metadata",
            "fifo_priority",
            "send_loading_state",
            "connect_timeout",
            "response_header_timeout",
            "max_run_time",
            "stream_idle_timeout",
            "pass_credentials",
            "gpu_memory_mib",
            "capabilities",
            "ignore_websockets",
            "kind",
            "output_dir",
            "sleep",
        },
    }
    for struct, fields in printed.items():
        assert set(struct.__struct_fields__) == fields | DERIVED[struct], struct


def test_check_config_yaml_output_passes_check_config(tmp_path: Path) -> None:
    source = tmp_path / "source.yaml"
    source.write_text(EVERYTHING)
    cli = [sys.executable, "-m", "app.cli", "check-config"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for output in ("yaml", "json"):
        printed = subprocess.run(
            [*cli, "--format", output, str(source)], env=env, capture_output=True, text=True
        )
        assert printed.returncode == 0, printed.stderr
        written = tmp_path / f"x.{output}"
        written.write_text(printed.stdout)
        again = subprocess.run([*cli, str(written)], env=env, capture_output=True, text=True)
        assert again.returncode == 0, again.stderr
        assert again.stdout.startswith(f"{written}: ok, 3 models, 2 warnings"), again.stdout
        assert again.stderr.count("not found on PATH") == 2, again.stderr
    assert msgspec.json.decode(printed.stdout)["models"]["a"]["ttl"] == 10


def test_a_database_url_prints_as_url_with_its_password_masked() -> None:
    config = parse_config(
        "models:\n  m:\n    cmd: run ${PORT}\n"
        "database:\n  url: postgresql+psycopg://gpulane:s3cret@db.internal:5432/gpulane\n"
        "  leaseSeconds: 30\n"
    )
    database = file_form(config)["database"]
    assert database["url"] == "postgresql+psycopg://gpulane:***@db.internal:5432/gpulane"
    assert "path" not in database and database["leaseSeconds"] == 30
    assert "s3cret" not in str(file_form(config))
