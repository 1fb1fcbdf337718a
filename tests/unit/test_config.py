"""Config loading: llama-swap compatibility, strict errors, macros, check-config."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.config import Config, ConfigError, load_config, parse_config
from app.config.callers import PASSABLE_CREDENTIALS
from app.config.macros import split_args, strip_comments
from app.config.raw import DEFAULT_IGNORE_PATHS
from app.config.resolution import NEVER_MATCHES
from app.config.resolved import masked
from app.runtime.parameters import server_started

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "config.example.yaml"
CREDENTIALS = tuple(sorted(PASSABLE_CREDENTIALS))
LLAMA_SWAP = ROOT / "tests" / "fixtures" / "config" / "llama-swap.yaml"
ENV = {"HOME": "/home/tester"}


def parse(text: str, environ: dict[str, str] | None = None) -> Config:
    return parse_config(textwrap.dedent(text), environ=ENV if environ is None else environ)


def errors_of(text: str, environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse(text, environ)
    assert str(caught.value) == "\n".join(caught.value.errors)
    return caught.value.errors


def one_model(extra: str = "", cmd: str = "server --port ${PORT}") -> str:
    body = textwrap.indent(textwrap.dedent(extra), "    ")
    return f"models:\n  m:\n    cmd: {cmd}\n{body}"


def serial_settings(line: str) -> str:
    return f"routing:\n  scheduler:\n    settings:\n      serial:\n        {line}\n"


# --- loading real configs ---------------------------------------------------------


def test_example_config_loads_with_home_from_environ() -> None:
    config = load_config(EXAMPLE, environ=ENV)

    assert list(config.models) == ["smollm2", "smollm2-long"]
    short, long = config.models["smollm2"], config.models["smollm2-long"]
    server = "/home/tester/.cache/gpulane/bin/llama-server"
    gguf = "/home/tester/.cache/gpulane/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert short.cmd == (server, "--port", "5800", "-m", gguf, "-c", "2048", "--log-disable")
    assert long.cmd == (server, "--port", "5801", "-m", gguf, "-c", "4096", "--log-disable")
    assert (short.proxy, long.proxy) == ("http://localhost:5800", "http://localhost:5801")
    assert config.resolve_model("smollm2-4k") == "smollm2-long"
    assert config.warnings == ()
    assert config.scheduler == "serial"
    assert config.database_path == "gpulane.db"
    assert (short.max_run_time, long.stream_idle_timeout, config.shutdown_grace) == (7200, 1200, 30)
    assert config.source == str(EXAMPLE)


def test_example_config_runs_what_make_llama_built_wherever_the_cache_is() -> None:
    """`GPULANE_CACHE=DIR make run` builds into DIR and serves the example config:
    the config names DIR's files, by the rule tools/fetch_llama.py builds by."""
    from tools import fetch_llama

    elsewhere = {**ENV, "GPULANE_CACHE": "/srv/cache"}
    config = load_config(EXAMPLE, environ=elsewhere)
    short = config.models["smollm2"]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "environ", elsewhere)
        built = (str(fetch_llama.server_path()), str(fetch_llama.model_path()))
    assert built == (
        "/srv/cache/bin/llama-server",
        "/srv/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    )
    assert (short.cmd[0], short.cmd[4]) == built
    # Unset or empty, both take the one default; `~` is the home directory.
    for value in ("", None, "~/.cache/gpulane"):
        environ = ENV if value is None else {**ENV, "GPULANE_CACHE": value}
        assert load_config(EXAMPLE, environ=environ).models["smollm2"].cmd[0] == (
            "/home/tester/.cache/gpulane/bin/llama-server"
        )


def test_llama_swap_config_loads_with_one_warning_per_ignored_key() -> None:
    config = load_config(
        LLAMA_SWAP, environ={**ENV, "API_KEY_1": "sk-env", "OPENROUTER_API_KEY": "sk-or"}
    )

    ignored = sorted(w.split(":", 1)[0] for w in config.warnings if "ignored" in w)
    gpt = "models.gpt-oss-120b"
    assert ignored == sorted(
        [
            "logTimeFormat",
            "logToStdout",
            "metricsMaxInMemory",
            "captureBuffer",
            "profiles",
            f"{gpt}.timeouts.keepalive",
            f"{gpt}.timeouts.tlsHandshake",
            f"{gpt}.timeouts.expectContinue",
            f"{gpt}.timeouts.idleConn",
        ]
    )
    assert [w for w in config.warnings if "ignored" not in w] == [
        "hooks.on_startup.preload[1]: unknown model 'retired-model', not preloaded"
    ]
    assert config.health_check_timeout == 500
    assert [k.key for k in config.api_keys] == ["sk-hunter2", "sk-env"]
    # llama-swap's plain strings: admin keys labelled by position, no priority policy.
    assert [(k.label, k.role, k.max_priority, k.default_priority) for k in config.api_keys] == [
        ("key#1", "admin", None, 0),
        ("key#2", "admin", None, 0),
    ]
    assert config.preload == ("gpt-oss-120b",)  # given as an alias; the unknown one skipped


def test_llama_swap_model_settings_resolve() -> None:
    config = load_config(
        LLAMA_SWAP, environ={**ENV, "API_KEY_1": "k", "OPENROUTER_API_KEY": "sk-or"}
    )
    gpt = config.models["gpt-oss-120b"]
    assert gpt.ignore_websockets  # compat.ignoreWebsockets
    assert not config.models["qwen-unlisted"].ignore_websockets

    # model macros override global ones, even inside other global macros
    assert gpt.cmd == (
        "/opt/llama.cpp/llama-server",
        "--port",
        "10001",
        "--model",
        "/home/tester/models/gpt-oss-120B.gguf",
        "--ctx-size",
        "16384",
        "--temperature",
        "0.7",
    )
    assert gpt.metadata["port"] == 10001  # a lone macro keeps its type
    assert gpt.metadata["temperature"] == 0.7
    assert gpt.metadata["note"] == (
        "The gpt-oss-120b is running on port 10001 temp=0.7, context=16384"
    )
    assert gpt.strip_params == ("temperature", "top_p", "top_k")
    assert gpt.set_params == {"temperature": 0.7, "top_p": 0.9}
    assert gpt.env == {"CUDA_VISIBLE_DEVICES": "0,1,2"}
    assert gpt.ttl == 60
    assert gpt.use_model_name == "openai/gpt-oss-120B"
    assert gpt.concurrency_limit == 1  # 0 means the default: serial's 1
    assert gpt.send_loading_state is False  # model overrides the global true

    docker = config.models["docker-llama"]
    assert docker.port is None
    assert docker.proxy == "http://127.0.0.1:9790"
    assert docker.cmd_stop == ("docker", "stop", "docker-llama")
    assert docker.check_endpoint is None
    assert docker.ttl == 300  # globalTTL
    assert docker.unload_timeout == 30
    # llama-swap's timeouts block, in its own units (seconds)
    assert (gpt.connect_timeout, gpt.response_header_timeout) == (30, 60)
    assert (docker.connect_timeout, docker.response_header_timeout) == (10, 3600)
    assert config.models["qwen-unlisted"].unlisted is True


# --- strictness ------------------------------------------------------------------


def test_unknown_key_names_full_path_and_closest_key() -> None:
    errors = errors_of(one_model("chekEndpoint: /health\n"))
    assert errors == ["models.m.chekEndpoint: unknown key; did you mean 'checkEndpoint'?"]


def test_snake_case_key_suggests_camel_case() -> None:
    errors = errors_of(one_model() + "health_check_timeout: 10\n")
    assert errors == ["health_check_timeout: unknown key; did you mean 'healthCheckTimeout'?"]


def test_unknown_key_without_close_match_lists_allowed_keys() -> None:
    # gpulane's own sections stay strict.
    (error,) = errors_of(one_model() + "database:\n  zzz: 1\n")
    assert error.startswith(
        "database.zzz: unknown key; allowed keys: leaseSeconds, path, synchronous, url"
    )


def test_unknown_key_in_a_llama_swap_section_loads_with_a_warning_naming_it() -> None:
    # llama-swap ignores it; a near miss of a key gpulane reads stays an error.
    config = parse(one_model("bogus: 1\n") + "routing:\n  zzz: 1\n")
    assert "models.m.bogus: unknown key ignored, as llama-swap ignores it" in config.warnings
    assert "routing.zzz: unknown key ignored, as llama-swap ignores it" in config.warnings
    assert errors_of(one_model("tll: 5\n")) == ["models.m.tll: unknown key; did you mean 'ttl'?"]


def test_all_errors_are_reported_together() -> None:
    errors = errors_of(
        """
        logLevel: verbose
        startPort: 0
        models:
          a:
            cmd: server --port ${PORT}
            ttl: 5m
            tll: 1
          b:
            proxy: http://localhost:9000
        """
    )
    assert len(errors) == 5, errors
    text = "\n".join(errors)
    assert "logLevel: 'verbose' is not allowed; expected one of debug, info, warn, error" in text
    assert "startPort: 0 is out of range; expected 1..65535" in text
    assert "models.a.ttl: expected a number, got '5m' (a string)" in text
    assert "models.a.tll: unknown key; did you mean 'ttl'?" in text
    assert "models.b.cmd: required key is missing" in text


def test_wrong_type_names_key_value_and_expected_type() -> None:
    errors = errors_of(one_model("unlisted: 3\nenv: [A=1, 7]\n"))
    assert "models.m.unlisted: expected a boolean, got 3 (an integer)" in errors
    assert "models.m.env[1]: expected a string, got 7 (an integer)" in errors


@pytest.mark.parametrize("bonus", [-1, 100])
def test_swap_affinity_bonus_out_of_range_names_key_value_and_range(bonus: int) -> None:
    (error,) = errors_of(one_model() + serial_settings(f"swapAffinityBonus: {bonus}"))
    assert error.startswith(
        f"routing.scheduler.settings.serial.swapAffinityBonus: {bonus} is out of range; "
        "expected an integer 0..99"
    )


@pytest.mark.parametrize("key", ["fairShareBonus", "shortJobBonus", "tierSpan"])
@pytest.mark.parametrize("points", [-1, 100])
def test_bounded_terms_out_of_range_name_key_value_and_range(key: str, points: int) -> None:
    (error,) = errors_of(one_model() + serial_settings(f"{key}: {points}"))
    assert error.startswith(
        f"routing.scheduler.settings.serial.{key}: {points} is out of range; "
        "expected an integer 0..99"
    )


def test_bounded_terms_that_could_lift_a_request_into_the_next_band_are_refused() -> None:
    settings = "{swapAffinityBonus: 40, fairShareBonus: 30, shortJobBonus: 28, tierSpan: 2}"
    text = one_model() + serial_settings("").replace("serial:\n        \n", f"serial: {settings}\n")
    (error,) = errors_of(text)
    assert error == (
        "routing.scheduler.settings.serial: swapAffinityBonus 40 + fairShareBonus 30 + "
        "shortJobBonus 28 + tierSpan 2 = 100 could lift a request into the next band; "
        "together they may be at most 99"
    )
    allowed = text.replace("shortJobBonus: 28", "shortJobBonus: 27")
    config = parse(allowed)
    assert (config.fair_share_bonus, config.short_job_bonus, config.tier_span) == (30, 27, 2)


@pytest.mark.parametrize("key", ["maxQueued", "maxQueuedPerCaller"])
def test_queue_bounds_must_be_positive(key: str) -> None:
    (error,) = errors_of(f"{key}: 0\n" + one_model())
    assert error == f"{key}: 0 is out of range; expected an integer >= 1"


def test_a_keys_own_queue_bound_replaces_the_per_caller_one() -> None:
    config = parse(
        "maxQueuedPerCaller: 5\napiKeys:\n  - {key: sk-a, label: a, maxQueued: 2}\n"
        "  - {key: sk-b, label: b}\n" + one_model()
    )
    assert config.caller_queue_limit("a") == 2
    assert config.caller_queue_limit("b") == 5
    assert config.caller_queue_limit(None) == 5
    assert (parse(one_model()).max_queued, parse(one_model()).max_queued_per_caller) == (
        100_000,
        10_000,
    )


def test_defaults_keep_the_new_terms_off() -> None:
    config = parse(one_model())
    assert (config.fair_share_bonus, config.short_job_bonus, config.tier_span) == (0, 0, 2)


def test_a_key_offset_outside_the_tier_span_is_warned_about() -> None:
    config = parse(
        "apiKeys:\n  - {key: sk-a, label: a, role: user, maxPriority: interactive+5}\n"
        + one_model()
    )
    (warning,) = config.warnings
    assert warning.startswith("apiKeys[0].maxPriority: 105 is +5 from its band's base")
    assert "tierSpan (2" in warning


@pytest.mark.parametrize(
    ("value", "problem"),
    [("-1", "-1.0 is out of range"), ("0.0000000001", "1e-10 has too many decimal places")],
)
def test_aging_divisor_out_of_range_names_key_value_and_range(value: str, problem: str) -> None:
    (error,) = errors_of(one_model() + serial_settings(f"agingDivisor: {value}"))
    assert error.startswith(f"routing.scheduler.settings.serial.agingDivisor: {problem}")
    assert "a number >= 0 (0 disables aging) with at most 9 decimal places" in error


@pytest.mark.parametrize(
    ("value", "ns"),
    [("60", 60_000_000_000), ("0", 0), ("0.1", 100_000_000), ("1.000000001", 1_000_000_001)],
)
def test_aging_divisor_converts_exactly_to_nanoseconds(value: str, ns: int) -> None:
    config = parse(one_model() + serial_settings(f"agingDivisor: {value}"))
    assert config.aging_divisor_ns == ns


def test_duplicate_alias_across_models_is_an_error() -> None:
    errors = errors_of(
        """
        models:
          a: {cmd: "x --port ${PORT}", aliases: [shared]}
          b: {cmd: "y --port ${PORT}", aliases: [shared]}
        """
    )
    assert errors == ["models.b.aliases[0]: alias 'shared' is already an alias of 'a'"]


def test_alias_equal_to_another_model_id_is_an_error() -> None:
    errors = errors_of(
        """
        models:
          a: {cmd: "x --port ${PORT}", aliases: [b]}
          b: {cmd: "y --port ${PORT}"}
        """
    )
    assert errors == ["models.a.aliases[0]: alias 'b' is also a model id"]


def test_port_in_proxy_but_not_in_cmd_is_an_error() -> None:
    errors = errors_of(one_model("proxy: http://localhost:${PORT}\n", cmd="server --port 9000"))
    assert errors == ["models.m.proxy: uses ${PORT} but cmd does not use ${PORT}"]


def test_default_proxy_needs_port_in_cmd() -> None:
    (error,) = errors_of(one_model(cmd="server --port 9000"))
    assert error.startswith("models.m.proxy: not set, and the default http://localhost:${PORT}")


def test_duplicate_yaml_key_is_an_error() -> None:
    errors = errors_of(
        """
        models:
          m: {cmd: "x --port ${PORT}"}
          m: {cmd: "y --port ${PORT}"}
        """
    )
    assert any("duplicate key 'm'" in e for e in errors)


def test_invalid_yaml_names_line_and_column() -> None:
    errors = errors_of("models:\n  m: {cmd: x\n")
    assert len(errors) == 1
    assert errors[0].startswith("<string>: invalid YAML: line 3, column 1:")


def test_fifo_priority_must_name_known_models() -> None:
    errors = errors_of(
        one_model()
        + "routing:\n  scheduler:\n    use: fifo\n    settings:\n      fifo:\n"
        + "        priority: {ghost: 1}\n"
    )
    assert errors == ["routing.scheduler.settings.fifo.priority.ghost: unknown model 'ghost'"]


def test_preload_of_an_unknown_model_warns_and_is_skipped_as_in_llama_swap() -> None:
    config = parse(one_model() + "hooks:\n  on_startup:\n    preload: [mm, ' m ', '', m]\n")
    assert config.preload == ("m",)  # trimmed, blank dropped, listed once
    assert config.warnings == (
        "hooks.on_startup.preload[0]: unknown model 'mm', not preloaded; did you mean 'm'?",
    )


def test_fifo_priority_applies_per_model_with_default_zero() -> None:
    config = parse(
        """
        routing:
          scheduler:
            use: fifo
            settings: {fifo: {priority: {a: 10, b: -5}}}
        models:
          a: {cmd: "x --port ${PORT}"}
          b: {cmd: "x --port ${PORT}"}
          c: {cmd: "x --port ${PORT}"}
        """
    )
    assert config.scheduler == "fifo"
    assert [m.fifo_priority for m in config.models.values()] == [10, -5, 0]


@pytest.mark.parametrize(("use", "default"), [("serial", 1), ("fifo", 10)])
def test_concurrency_limit_applies_under_both_schedulers_with_their_own_default(
    use: str, default: int
) -> None:
    config = parse(
        f"""
        routing: {{scheduler: {{use: {use}}}}}
        models:
          a: {{cmd: "x --port ${{PORT}}", concurrencyLimit: 3}}
          b: {{cmd: "x --port ${{PORT}}", concurrencyLimit: 0}}
          c: {{cmd: "x --port ${{PORT}}"}}
        """
    )
    assert [m.concurrency_limit for m in config.models.values()] == [3, default, default]
    assert config.warnings == ()


def test_ignored_hook_warns_but_a_misspelt_one_is_an_error() -> None:
    config = parse(one_model() + "hooks:\n  on_shutdown: {}\n")
    assert config.warnings == (
        "hooks.on_shutdown: llama-swap key ignored: gpulane only runs hooks.on_startup",
    )
    errors = errors_of(one_model() + "hooks:\n  on_statup: {}\n")
    assert errors == ["hooks.on_statup: unknown key; did you mean 'on_startup'?"]


# --- ports and cmd -----------------------------------------------------------------


def test_ports_assigned_in_sorted_id_order_only_to_models_using_port() -> None:
    config = parse(
        """
        startPort: 7000
        models:
          zeta: {cmd: "srv --port ${PORT}"}
          alpha: {cmd: "srv --port ${PORT}"}
          fixed: {cmd: "srv --port 9999", proxy: "http://127.0.0.1:9999"}
          mid: {cmd: "srv --port ${PORT}"}
        """
    )
    ports = {model_id: model.port for model_id, model in config.models.items()}
    assert ports == {"alpha": 7000, "fixed": None, "mid": 7001, "zeta": 7002}
    assert config.models["mid"].proxy == "http://localhost:7001"


def test_port_in_a_user_macro_counts_as_cmd_using_port() -> None:
    config = parse('macros: {srv: "server --port ${PORT}"}\n' + one_model(cmd="${srv} -m x"))
    assert config.models["m"].cmd == ("server", "--port", "5800", "-m", "x")


def test_multiline_cmd_with_comments_continuations_and_quotes_splits_like_a_shell() -> None:
    config = parse(
        r"""
        models:
          m:
            cmd: |
              # the server binary
              /opt/llama-server --port ${PORT} \
                --alias 'my model'   # trailing comment
              --chat-template "a # not a comment"
                --color=#fff --url=http://h/#frag
              --joined=a\
              b
              --escaped \"q\"
        """
    )
    assert config.models["m"].cmd == (
        "/opt/llama-server",
        "--port",
        "5800",
        "--alias",
        "my model",
        "--chat-template",
        "a # not a comment",
        "--color=#fff",
        "--url=http://h/#frag",
        "--joined=ab",
        "--escaped",
        '"q"',
    )


def test_comment_in_cmd_may_mention_an_undefined_macro() -> None:
    assert strip_comments("# uses ${nothing}\nrun") == "\nrun"


@given(st.lists(st.text(min_size=1), min_size=1, max_size=6))
def test_quoted_arguments_survive_comment_stripping_and_splitting(argv: list[str]) -> None:
    assert split_args(strip_comments(shlex.join(argv))) == argv


def test_unbalanced_quote_in_cmd_is_an_error() -> None:
    errors = errors_of(one_model(cmd='"srv --port ${PORT} \'open"'))
    assert errors == ["models.m.cmd: cannot split into arguments: No closing quotation"]


def test_cmd_stop_keeps_pid_for_the_runtime() -> None:
    config = parse(one_model("cmdStop: kill -INT ${PID}\n"))
    assert config.models["m"].cmd_stop == ("kill", "-INT", "${PID}")
    errors = errors_of(one_model(cmd="srv --port ${PORT} --pid ${PID}"))
    assert errors == ["models.m.cmd: ${PID} is only available in cmdStop"]


# --- macros ---------------------------------------------------------------------------


def test_missing_env_variable_is_an_error_naming_it() -> None:
    errors = errors_of(one_model(cmd="srv --port ${PORT} -m ${env.GPULANE_MODELS}/x.gguf"))
    assert errors == [
        "models.m.cmd: environment variable GPULANE_MODELS is not set "
        "(used as ${env.GPULANE_MODELS})"
    ]


def test_missing_env_variable_in_a_macro_is_reported_once_at_the_macro() -> None:
    errors = errors_of(
        """
        macros: {dir: "${env.NOPE}/models"}
        models:
          a: {cmd: "srv --port ${PORT} ${dir}"}
          b: {cmd: "srv --port ${PORT} ${dir}"}
        """
    )
    assert errors == ["macros.dir: environment variable NOPE is not set (used as ${env.NOPE})"]


def test_a_macro_using_itself_is_an_error() -> None:
    errors = errors_of('macros: {a: "x ${a}"}\n' + one_model(cmd="srv --port ${PORT} ${a}"))
    assert errors == ["macros.a: uses itself"]


def test_a_macro_may_use_only_the_macros_defined_before_it() -> None:
    # llama-swap substitutes macros last to first, so a later one stays literal
    # and is refused (its TestConfig_MacroForwardReferenceRejected); a cycle
    # always has such a reference.
    errors = errors_of('macros: {a: "x ${b}", b: "${c}", c: "${a}"}\n' + one_model())
    assert errors == [
        "macros.a: uses ${b}, which is defined after it; a macro may use only the macros "
        "defined before it",
        "macros.b: uses ${c}, which is defined after it; a macro may use only the macros "
        "defined before it",
    ]
    config = parse(
        'macros: {b: srv, ctx: 2048, a: "${b} -c ${ctx}"}\n' + one_model(cmd="${a} --port ${PORT}")
    )
    assert config.models["m"].cmd == ("srv", "-c", "2048", "--port", "5800")


def test_a_model_macro_may_use_the_global_ones_and_its_own_defined_before_it() -> None:
    config = parse(
        "macros: {dir: /srv}\n"
        + one_model(
            cmd="${bin} --port ${PORT}",
            extra='macros: {name: x, bin: "${dir}/${name}-${MODEL_ID}"}\n',
        )
    )
    assert config.models["m"].cmd == ("/srv/x-m", "--port", "5800")


def test_unknown_macro_names_model_and_macro() -> None:
    errors = errors_of(one_model(cmd="srv --port ${PORT} -c ${ctxx}"))
    assert errors == ["models.m.cmd: unknown macro ${ctxx}"]


def test_reserved_macro_name_is_an_error() -> None:
    errors = errors_of("macros: {MODEL_ID: x}\n" + one_model())
    assert errors == ["macros.MODEL_ID: MODEL_ID is a reserved macro name"]


def test_macros_expand_in_env_and_check_endpoint() -> None:
    config = parse(
        'macros: {root: "/srv"}\n'
        + one_model('env: ["DIR=${root}/${MODEL_ID}", "P=${PORT}"]\ncheckEndpoint: /ready\n')
    )
    model = config.models["m"]
    assert model.env == {"DIR": "/srv/m", "P": "5800"}
    assert model.check_endpoint == "/ready"


# --- defaults and gpulane keys -----------------------------------------------------------


def test_defaults() -> None:
    config = parse(one_model())
    model = config.models["m"]
    assert (config.health_check_timeout, config.start_port, config.log_level) == (120, 5800, "info")
    assert (config.scheduler, config.aging_divisor, config.swap_affinity_bonus) == (
        "serial",
        60,
        10,
    )
    assert (config.database_path, config.database_synchronous) == ("gpulane.db", "full")
    assert (config.result_retention_s, config.max_attempts) == (7 * 86400, 3)
    assert config.max_body_bytes == 64 * 1024 * 1024
    assert config.ignore_paths == DEFAULT_IGNORE_PATHS
    assert (config.api_keys, config.preload, config.send_loading_state) == ((), (), False)
    assert model.check_endpoint == "/health"
    assert (model.ttl, model.unload_timeout, model.concurrency_limit) == (0, 10, 1)
    assert (model.aliases, model.strip_params, model.cmd_stop, model.fifo_priority) == (
        (),
        (),
        None,
        0,
    )
    # Generous enough for a 16-minute render, streamed (headers first) or not.
    assert (model.connect_timeout, model.response_header_timeout) == (10, 3600)
    assert (model.max_run_time, model.stream_idle_timeout) == (7200, 1200)
    assert config.shutdown_grace == 30


# --- time limits ----------------------------------------------------------------------


def test_llama_swap_timeouts_resolve_in_seconds_and_zero_means_no_limit() -> None:
    config = parse(
        """
        models:
          set:
            cmd: x --port ${PORT}
            timeouts: {connect: 5, responseHeader: 1.5}
          unlimited:
            cmd: x --port ${PORT}
            timeouts: {connect: 0, responseHeader: 0}
          empty:
            cmd: x --port ${PORT}
            timeouts:
        """
    )
    limits = {
        model_id: (m.connect_timeout, m.response_header_timeout)
        for model_id, m in config.models.items()
    }
    assert limits == {"empty": (10, 3600), "set": (5, 1.5), "unlimited": (None, None)}
    assert config.warnings == ()


def test_llama_swap_timeout_keys_without_a_gpulane_meaning_warn_once_each() -> None:
    config = parse(
        one_model("timeouts: {keepalive: 30, tlsHandshake: 10, expectContinue: 1, idleConn: 90}\n")
    )
    assert [w.split(": ", 1)[0] for w in config.warnings] == [
        "models.m.timeouts.keepalive",
        "models.m.timeouts.tlsHandshake",
        "models.m.timeouts.expectContinue",
        "models.m.timeouts.idleConn",
    ]
    assert all(": llama-swap key ignored: " in w for w in config.warnings)
    assert config.models["m"].connect_timeout == 10


def test_llama_swap_timeouts_take_numbers_and_known_keys_only() -> None:
    errors = errors_of(one_model("timeouts: {connect: 5s, respnseHeader: 1}\n"))
    assert errors == [
        "models.m.timeouts.connect: expected a number, got '5s' (a string)",
        "models.m.timeouts.respnseHeader: unknown key; did you mean 'responseHeader'?",
    ]


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("timeouts: {connect: -1}", "models.m.timeouts.connect"),
        ("timeouts: {responseHeader: -1}", "models.m.timeouts.responseHeader"),
        ("maxRunTime: -1", "models.m.maxRunTime"),
        ("streamIdleTimeout: -1", "models.m.streamIdleTimeout"),
    ],
)
def test_negative_model_time_limit_is_an_error_naming_the_key(text: str, key: str) -> None:
    (error,) = errors_of(one_model(text + "\n"))
    assert error.startswith(f"{key}: -1 is out of range; expected seconds >= 0 (0 = no limit)")


@pytest.mark.parametrize("key", ["maxRunTime", "streamIdleTimeout", "shutdownGrace"])
def test_negative_top_level_time_is_an_error_naming_the_key(key: str) -> None:
    (error,) = errors_of(one_model() + f"{key}: -1\n")
    assert error.startswith(f"{key}: -1 is out of range; expected seconds >= 0")


def test_run_limits_accept_durations_and_a_model_overrides_the_top_level_value() -> None:
    config = parse(
        """
        maxRunTime: 4h
        streamIdleTimeout: 30m
        shutdownGrace: 2m
        models:
          inherits: {cmd: "x --port ${PORT}"}
          own: {cmd: "x --port ${PORT}", maxRunTime: 90, streamIdleTimeout: 1h30m}
          unlimited: {cmd: "x --port ${PORT}", maxRunTime: 0, streamIdleTimeout: 0}
        """
    )
    limits = {
        model_id: (m.max_run_time, m.stream_idle_timeout) for model_id, m in config.models.items()
    }
    assert limits == {
        "inherits": (4 * 3600, 30 * 60),
        "own": (90, 5400),
        "unlimited": (None, None),
    }
    assert config.shutdown_grace == 120
    assert parse(one_model() + "shutdownGrace: 0\n").shutdown_grace == 0  # stop at once


def test_load_backoff_defaults_accept_durations_and_reach_server_started() -> None:
    default = parse(one_model())
    assert (default.load_backoff, default.load_backoff_max, default.load_failure_limit) == (
        5,
        300,
        3,
    )
    # Left at their defaults they hash as before they existed.
    assert default.config_hash == parse(one_model() + "loadFailureLimit: 3\n").config_hash
    config = parse(one_model() + "loadBackoff: 1m\nloadBackoffMax: 1h\nloadFailureLimit: 0\n")
    assert (config.load_backoff, config.load_backoff_max, config.load_failure_limit) == (
        60,
        3600,
        0,
    )
    assert config.config_hash != default.config_hash
    started = server_started(config, 0, 0)
    assert (
        started.load_backoff_ns,
        started.load_backoff_max_ns,
        started.load_failure_limit,
    ) == (60 * 10**9, 3600 * 10**9, 0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("loadBackoff: -1", "loadBackoff: -1 is out of range; expected seconds >= 0"),
        ("loadBackoffMax: 2w", "loadBackoffMax: '2w' is not a duration"),
        (
            "loadBackoff: 10\nloadBackoffMax: 5",
            "loadBackoffMax: 5 is less than loadBackoff (10); expected seconds >= loadBackoff",
        ),
        ("loadFailureLimit: -1", "loadFailureLimit: -1 is out of range; expected an integer >= 0"),
    ],
)
def test_bad_load_backoff_settings_name_the_key(text: str, message: str) -> None:
    (error,) = errors_of(one_model() + text + "\n")
    assert error.startswith(message)


def test_bad_duration_names_the_key_and_the_allowed_forms() -> None:
    (error,) = errors_of(one_model("maxRunTime: 2w\n"))
    assert error == (
        "models.m.maxRunTime: '2w' is not a duration; expected seconds >= 0 (0 = no limit), "
        'or a duration like "7d", "12h", "30m", "45s" or "1d12h"'
    )


# --- compat -----------------------------------------------------------------------------


def test_compat_ignore_websockets_resolves_into_the_model() -> None:
    config = parse(one_model("compat:\n  ignoreWebsockets: true\n"))
    assert config.warnings == () and config.models["m"].ignore_websockets
    assert not parse(one_model("compat:\n")).models["m"].ignore_websockets
    assert errors_of(one_model("compat: {ignoreWebsockets: maybe}\n"))[0].startswith(
        "models.m.compat.ignoreWebsockets: expected a boolean"
    )


def test_compat_typo_is_an_error_naming_the_known_key() -> None:
    assert errors_of(one_model("compat: {ignoreWebSockets: true}\n")) == [
        "models.m.compat.ignoreWebSockets: unknown key; did you mean 'ignoreWebsockets'?"
    ]
    assert (
        "models.m.compat.zzz: unknown key ignored, as llama-swap ignores it"
        in parse(one_model("compat: {zzz: true}\n")).warnings
    )


@pytest.mark.parametrize(("model_ttl", "expected"), [(None, 300), (-1, 300), (0, 0), (45, 45)])
def test_model_ttl_merges_with_global_ttl(model_ttl: int | None, expected: float) -> None:
    extra = "" if model_ttl is None else f"ttl: {model_ttl}\n"
    assert parse("globalTTL: 300\n" + one_model(extra)).models["m"].ttl == expected


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("7d", 604800), ("12h", 43200), ("30m", 1800), ("45s", 45), ("1d12h", 129600), ("90", 90)],
)
def test_result_retention_accepts_seconds_or_durations(value: str, seconds: float) -> None:
    config = parse(one_model() + f"jobs: {{resultRetention: {value}}}\n")
    assert config.result_retention_s == seconds


def test_bad_result_retention_names_allowed_forms() -> None:
    (error,) = errors_of(one_model() + "jobs: {resultRetention: 2w}\n")
    assert error.startswith("jobs.resultRetention: '2w' is not a duration; expected seconds > 0")


def test_min_free_disk_is_a_byte_count_with_a_default_reserve() -> None:
    assert parse(one_model()).min_free_disk == 256 * 1024 * 1024
    assert parse(one_model() + "jobs: {minFreeDisk: 0}\n").min_free_disk == 0
    (error,) = errors_of(one_model() + "jobs: {minFreeDisk: -1}\n")
    assert error == "jobs.minFreeDisk: -1 is out of range; expected bytes, an integer >= 0"
    assert parse(one_model()).max_stored_bytes_per_caller == 4 << 30
    assert (
        parse(one_model() + "jobs: {maxStoredBytesPerCaller: 1}\n").max_stored_bytes_per_caller == 1
    )
    (error,) = errors_of(one_model() + "jobs: {maxStoredBytesPerCaller: 0}\n")
    assert error == (
        "jobs.maxStoredBytesPerCaller: 0 is out of range; expected bytes, an integer >= 1"
    )
    (error,) = errors_of(one_model() + "jobs: {maxStoredBytes: 1}\n")
    assert "maxStoredBytesPerCaller" in error, error


def test_strip_params_accepts_comma_string_or_list() -> None:
    from_string = parse(one_model('filters: {stripParams: "a, b ,,c"}\n'))
    from_list = parse(one_model("filters: {stripParams: [a, b, c]}\n"))
    assert from_string.models["m"].strip_params == from_list.models["m"].strip_params
    assert from_list.models["m"].strip_params == ("a", "b", "c")


def test_ignore_paths_accepts_a_list_of_regexes_or_empty() -> None:
    listed = parse(one_model() + "upstream: {ignorePaths: ['\\.js$', '^/static/']}\n")
    assert listed.ignore_paths == r"(?:\.js$)|(?:^/static/)"
    assert parse(one_model() + "upstream: {ignorePaths: ''}\n").ignore_paths == NEVER_MATCHES
    # An empty list is llama-swap's default, as in llama-swap (its load.go).
    default = parse(one_model()).ignore_paths
    assert parse(one_model() + "upstream: {ignorePaths: []}\n").ignore_paths == default
    assert re.search(default, "/favicon.ico") and not re.search(default, "/v1/chat")
    (error,) = errors_of(one_model() + "upstream: {ignorePaths: '(unclosed'}\n")
    assert error.startswith("upstream.ignorePaths: '(unclosed' is not a valid regex")


def test_config_hash_is_stable_and_changes_with_settings_and_keys() -> None:
    base = parse(one_model())
    assert base.config_hash == parse(one_model()).config_hash
    assert len(base.config_hash) == 16
    assert base.config_hash != parse(one_model() + "logLevel: debug\n").config_hash
    assert base.config_hash != parse(one_model() + "apiKeys: [k1]\n").config_hash
    assert (
        parse(one_model() + "apiKeys: [k1]\n").config_hash
        != parse(one_model() + "apiKeys: [k2]\n").config_hash
    )


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


# --- check-config -----------------------------------------------------------------------


def run_check_config(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": "/home/tester"}
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "check-config", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_check_config_prints_resolved_config_and_exits_0(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(one_model() + "apiKeys: [sk-secret]\ncaptureBuffer: 5\n")
    result = run_check_config(str(path), "--format", "yaml")
    assert result.returncode == 0, result.stderr
    assert "sk-secret" not in result.stdout
    assert "apiKeys:\n- '***1'\n" in result.stdout  # a plain string, as written
    assert "cmd: server --port 5800\n" in result.stdout  # the file's keys, resolved
    assert "warning: captureBuffer: llama-swap key ignored" in result.stderr


def test_check_config_says_what_matters_and_names_a_program_that_is_not_there(
    tmp_path: Path,
) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text(
        "models:\n"
        "  good:\n    cmd: python3 -m http.server ${PORT}\n"
        "  typo:\n    cmd: /usr/local/bin/llama-sever --port ${PORT}\n"
        "  lost:\n    cmd: llama-sever-nowhere --port ${PORT}\n"
    )
    result = run_check_config(str(path))
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert first == f"{path}: ok, 3 models, 2 warnings (above)"
    assert "'/usr/local/bin/llama-sever' is not an executable file" in result.stderr
    assert "models.typo.cmd" in result.stderr and "fail to start it (502)" in result.stderr
    assert "'llama-sever-nowhere' is not found on PATH" in result.stderr
    assert "llama-sever (NOT FOUND)" in result.stdout and "python3 ->" in result.stdout
    assert "aging_divisor_ns" not in result.stdout  # words for a person, not field names
    assert "router: no router (one model at a time)" in result.stdout


def test_check_config_json_output(tmp_path: Path) -> None:
    import json

    result = run_check_config(str(EXAMPLE), "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["models"]["smollm2"]["proxy"] == "http://localhost:5800"
    assert "--port 5800" in data["models"]["smollm2"]["cmd"]


def test_check_config_reports_errors_and_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(one_model("chekEndpoint: /x\n"))
    result = run_check_config(str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert "1 config error" in result.stderr
    assert "models.m.chekEndpoint: unknown key; did you mean 'checkEndpoint'?" in result.stderr


# --- callers: apiKeys entries as objects, passCredentials (issue 12) ----------------------

TIERS = """\
apiKeys:
  - key: sk-free
    label: free
    maxPriority: normal
  - key: sk-max
    label: max
    maxPriority: interactive+2
  - key: ${env.PRODUCER_KEY}
    label: producer
    role: user
    defaultPriority: -98
    maxPriority: batch+2
    weight: 3
  - sk-admin
  - key: sk-ops
    role: admin
"""


def test_api_key_objects_resolve_labels_roles_and_priority_policy() -> None:
    config = parse(one_model() + TIERS, environ={"PRODUCER_KEY": "sk-producer"})
    got = [
        (k.key, k.label, k.role, k.max_priority, k.default_priority, k.weight)
        for k in config.api_keys
    ]
    assert got == [
        ("sk-free", "free", "user", 0, 0, 1),
        ("sk-max", "max", "user", 102, 0, 1),
        ("sk-producer", "producer", "user", -98, -98, 3),
        ("sk-admin", "key#4", "admin", None, 0, 1),  # a plain string, labelled by position
        ("sk-ops", "key#5", "admin", None, 0, 1),  # an object without a label: the same
    ]
    assert config.caller_labels() == ("free", "max", "producer", "key#4", "key#5")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", 0),
        ("-98", -98),
        ("interactive", 100),
        ("Interactive + 2", 102),
        ("batch-1", -101),
        ("normal+0", 0),
        ("'-98'", -98),
        (str(2**63 - 1), 2**63 - 1),
    ],
)
def test_priority_settings_take_integers_bands_and_band_offsets(value: str, expected: int) -> None:
    config = parse(one_model() + f"apiKeys:\n  - key: k\n    maxPriority: {value}\n")
    assert config.api_keys[0].max_priority == expected


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        (
            "{key: k, lable: x}",
            "apiKeys[0].lable: unknown key; did you mean 'label'?",
        ),
        ("{label: x}", "apiKeys[0].key: required key is missing"),
        ("{key: ''}", "apiKeys[0].key: an API key must not be empty"),
        (
            "{key: ' k '}",
            "apiKeys[0].key: an API key must not start or end with whitespace "
            "(it could never be presented)",
        ),
        (
            "{key: k, role: root}",
            "apiKeys[0].role: 'root' is not allowed; expected one of admin, user",
        ),
        (
            "{key: k, maxPriority: interactive2}",
            "apiKeys[0].maxPriority: 'interactive2' is not a priority; expected an integer, "
            "interactive, normal or batch, optionally + or - an integer (interactive+2)",
        ),
        (
            "{key: k, defaultPriority: 1.5}",
            "apiKeys[0].defaultPriority: expected an integer or a string, got 1.5 (a number)",
        ),
        (
            f"{{key: k, maxPriority: {2**63}}}",
            f"apiKeys[0].maxPriority: {2**63} is out of range; expected -2^63..2^63-1",
        ),
        (
            "{key: k, maxPriority: 0, defaultPriority: interactive}",
            "apiKeys[0].defaultPriority: 100 is above maxPriority 0; every request "
            "without a header would be lowered",
        ),
        (
            "{key: k, weight: 0}",
            "apiKeys[0].weight: 0 is out of range; expected an integer 1..1000",
        ),
        ("{key: k, weight: 2.5}", "apiKeys[0].weight: expected an integer, got 2.5 (a number)"),
        (
            "{key: k, label: 'bob smith'}",
            "apiKeys[0].label: 'bob smith' is not a caller label; expected 1-64 characters "
            "of letters, digits and . _ - ~ @ : + # /",
        ),
        ("7", "apiKeys[0]: expected a string or a mapping, got 7 (an integer)"),
    ],
)
def test_bad_api_key_entries_are_errors_naming_the_entry(entry: str, error: str) -> None:
    assert error in errors_of(one_model() + f"apiKeys:\n  - {entry}\n")


def test_a_key_given_twice_is_an_error_that_does_not_print_it() -> None:
    errors = errors_of(one_model() + "apiKeys:\n  - sk-twice\n  - {key: sk-twice, label: b}\n")
    assert errors == ["apiKeys[1].key: the same key as apiKeys[0]; every key must be unique"]
    assert "sk-twice" not in "\n".join(errors)


def test_a_label_given_twice_is_an_error_even_against_a_positional_label() -> None:
    errors = errors_of(
        one_model()
        + "apiKeys:\n  - {key: a, label: team}\n  - {key: b, label: team}\n"
        + "  - c\n  - {key: d, label: 'key#3'}\n"
    )
    assert errors == [
        "apiKeys[1].label: 'team' is already the label of apiKeys[0]; labels must be unique",
        "apiKeys[3].label: 'key#3' is already the label of apiKeys[2]; labels must be unique",
    ]


def test_api_keys_enter_the_hash_and_the_display_only_masked() -> None:
    one = parse(one_model() + "apiKeys: [{key: sk-a, label: a}]\n")
    other = parse(one_model() + "apiKeys: [{key: sk-b, label: a}]\n")
    assert one.config_hash != other.config_hash
    shown = list(masked(one)["api_keys"])
    assert shown == [
        {
            "key": "***",
            "label": "a",
            "role": "user",
            "max_priority": None,
            "default_priority": 0,
            "weight": 1,
            "max_queued": None,
        }
    ]
    assert "sk-a" not in repr(one.api_keys) and "sk-a" not in repr(one)


@pytest.mark.parametrize(
    ("keys", "value", "passed"),
    [
        # Without apiKeys gpulane checks no credential, so a client's is meant for
        # the upstream and is forwarded, as llama-swap does.
        ("", None, CREDENTIALS),
        # With apiKeys the credential is gpulane's: never forwarded unless asked.
        ("apiKeys: [k]\n", None, ()),
        ("apiKeys: [k]\n", "true", CREDENTIALS),
        ("", "false", ()),
        ("apiKeys: [k]\n", "[Api-Key, authorization]", ("api-key", "authorization")),
    ],
)
def test_pass_credentials_resolves_to_the_credential_headers_forwarded(
    keys: str, value: str | None, passed: tuple[str, ...]
) -> None:
    extra = "" if value is None else f"passCredentials: {value}\n"
    config = parse(keys + one_model(extra))
    assert config.models["m"].pass_credentials == passed


def test_pass_credentials_names_only_credential_headers() -> None:
    errors = errors_of(one_model("passCredentials: [x-custom, proxy-authorization]\n"))
    allowed = ", ".join(CREDENTIALS)
    why = "other headers are always forwarded, proxy-authorization never"
    assert errors == [
        f"models.m.passCredentials[0]: 'x-custom' is not a credential header gpulane can "
        f"pass; expected one of {allowed} ({why})",
        f"models.m.passCredentials[1]: 'proxy-authorization' is not a credential header "
        f"gpulane can pass; expected one of {allowed} ({why})",
    ]


def test_database_lease_seconds_defaults_to_15_takes_durations_and_hashes_as_before() -> None:
    default = parse(one_model())
    assert default.database_lease_s == 15
    assert parse(one_model() + "database: {leaseSeconds: 1m}\n").database_lease_s == 60
    assert parse(one_model() + "database: {leaseSeconds: 2.5}\n").database_lease_s == 2.5
    # A config that leaves it unset hashes as one written before the key existed.
    assert default.config_hash == parse(one_model() + "database: {leaseSeconds: 15}\n").config_hash


@pytest.mark.parametrize("value", ["0", "0.5", "-3", "2h", "soon"])
def test_database_lease_seconds_out_of_range_is_an_error_naming_the_key(value: str) -> None:
    (error,) = errors_of(one_model() + f"database: {{leaseSeconds: {value}}}\n")
    assert error.startswith("database.leaseSeconds: ")
    assert "expected seconds from 1 to 3600" in error


def test_database_url_names_the_database_instead_of_the_path() -> None:
    url = "postgresql+psycopg://gpulane@db.internal:5432/gpulane"
    assert parse(one_model() + f"database:\n  url: {url}\n").database_path == url
    assert (
        parse(one_model() + "database:\n  url: sqlite:///x.db\n").database_path == "sqlite:///x.db"
    )
    errors = errors_of(one_model() + f"database:\n  url: {url}\n  path: other.db\n")
    assert errors == [
        "database.url: give database.url or database.path, not both (a path is a URL too)"
    ]
    (error,) = errors_of(one_model() + "database:\n  url: mysql://u@h/db\n")
    assert error.startswith("database.url: 'mysql' is not a database gpulane runs on")
    assert "postgresql+psycopg://" in error
