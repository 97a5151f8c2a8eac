"""The `trillm` command line answers its help and version, reaches the benchmark, and builds
the configs from the flags their fields declare."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from trillm import __version__
from trillm.cli import build_parser, serve_config
from trillm.cli._flags import serve_options
from trillm.common.config import WorkerConfig
from trillm.engine.client import EngineConfig, LLMConfig
from trillm.http import build_config


def trillm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trillm.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_version_and_help() -> None:
    assert trillm("--version").stdout.strip() == f"trillm {__version__}"
    help_text = trillm("serve", "--help").stdout
    for flag in ("--tensor-parallel-size", "--max-model-len", "--api-key", "--shutdown-timeout"):
        assert flag in help_text
    death = ("--engine-death-grace", "--keep-alive-on-engine-death", "--engine-watchdog-timeout")
    for flag in death:
        assert flag in help_text
    assert "--inject-fault" not in help_text  # a test hook, not an option


def test_engine_death_settings_out_of_range_are_refused_before_starting() -> None:
    run = trillm("serve", "no-such-model", "--engine-watchdog-timeout", "0.1")
    assert run.returncode == 1
    assert run.stderr == (
        "trillm serve: the engine watchdog timeout must be 0 (off) or at least 0.5 s "
        "(the heartbeat's jitter), got 0.1\n"
    )
    run = trillm("serve", "no-such-model", "--engine-death-grace", "-1")
    assert run.returncode == 1
    assert run.stderr == "trillm serve: --engine-death-grace must be >= 0 seconds, got -1.0\n"


def test_a_bad_speculative_config_is_refused_before_starting_naming_the_field() -> None:
    run = trillm("serve", "no-such-model", "--speculative-config", '{"method": "ngram"}')
    assert run.returncode == 1
    assert run.stderr == "trillm serve: --speculative-config num_speculative_tokens is required\n"
    spec = '{"method": "ngram", "num_speculative_tokens": 2, "draft": 1}'
    run = trillm("serve", "no-such-model", "--speculative-config", spec)
    assert run.returncode == 1
    assert "--speculative-config has unknown field 'draft'" in run.stderr


def test_bench_serve_is_reachable_from_the_cli() -> None:
    run = trillm("bench", "serve", "--help")
    assert run.returncode == 0 and "--request-rate" in run.stdout and "--goodput" in run.stdout


# -- the flags are the configs' declarations ---------------------------------------------------


def test_a_flag_sets_the_field_that_declares_it() -> None:
    flags = """--max-num-seqs 7 --kv-cache-memory-bytes 9 -tp 2 --engine-watchdog-timeout 8
        --stream-interval 0 --request-body-timeout 0 --shutdown-timeout 3
        --reasoning-parser qwen3 --port 9 --no-engine-restart --max-api-restarts 0
        --async-scheduling --cpu-decode torch"""
    args = build_parser().parse_args(["serve", "m", *flags.split()])
    command, config = serve_config(args)
    assert config.llm.engine.async_scheduling  # off unless given (the defaults' test)
    worker = config.llm.engine.worker
    assert (worker.model, worker.max_num_seqs, worker.kv_cache_bytes) == ("m", 7, 9)
    assert worker.cpu_decode == "torch"
    assert config.llm.engine.tensor_parallel_size == 2
    assert config.llm.watchdog_timeout == config.llm.engine.worker_watchdog_timeout == 8
    assert (config.http.stream_interval, config.http.request_body_timeout) == (1, None)
    assert (config.port, config.llm.max_engine_restarts, command.max_api_restarts) == (9, 0, 0)
    # one owner each, the engine client's config; the HTTP layer keeps no copy
    assert (config.llm.shutdown_timeout, config.llm.reasoning_parser) == (3, "qwen3")
    assert not hasattr(config.http, "shutdown_timeout")
    assert not hasattr(config.http, "reasoning_parser")


def test_the_flags_default_to_their_fields_but_where_the_server_says_otherwise() -> None:
    parsed = vars(build_parser().parse_args(["serve"]))
    options = serve_options()
    assert set(parsed) == {"command", "model", *options}
    # A repeatable flag's list becomes its field's tuple (`flags.fields_from`).
    taken = {d: tuple(v) if options[d].flag.many else v for d, v in parsed.items() if d in options}
    differ = {dest for dest, o in options.items() if o.default != taken[dest]}
    assert differ == set()
    cli_defaults = {dest: o.flag.cli_default for dest, o in options.items() if o.flag.cli_default}
    assert cli_defaults == {"host": "127.0.0.1", "port": 8000, "max_engine_restarts": 3}


def test_build_config_refuses_a_name_that_is_no_flag() -> None:
    with pytest.raises(TypeError, match=r"^build_config\(\) got an unexpected flag 'max_num_seq'$"):
        build_config(
            worker=WorkerConfig("m"), served_model_name="m", host="h", port=0, max_num_seq=1
        )


def test_the_tokenizer_has_one_owner_the_engines() -> None:
    engine = EngineConfig(worker=WorkerConfig("m"))
    assert LLMConfig(engine, tokenizer="t").engine.tokenizer == "t"
    config = LLMConfig(msgspec.structs.replace(engine, tokenizer="u"))
    assert config.tokenizer == config.engine.tokenizer == "u"
    with pytest.raises(
        ValueError, match=r"^tokenizer 't' differs from the engine's 'u': give it once$"
    ):
        LLMConfig(msgspec.structs.replace(engine, tokenizer="u"), tokenizer="t")
