"""perf/bench_serve.py: metrics on synthetic timings, datasets, arrivals, and a real run."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trillm.default_model import DEFAULT_MODEL_NAME, default_model_dir, find_default_gguf
from trillm.http.openai._info_responses import models_response

from ..gpu.conftest import save_tiny
from ..http.conftest import Server, free_port, start_server

PERF = Path(__file__).resolve().parents[2] / "perf"
sys.path.insert(0, str(PERF))  # perf/ is scripts, not a package

from _bench_client import ClientConfig, arrival_delays, chunk_text, request_body  # noqa: E402
from _bench_datasets import (  # noqa: E402
    DatasetError,
    SampleRequest,
    load_tokenizer,
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)
from _bench_metrics import (  # noqa: E402
    RequestOutput,
    compute_metrics,
    meets_slos,
    parse_goodput,
    percentile,
)
from _bench_tokenizer import TokenizerNotFoundError, find_tokenizer  # noqa: E402


def output(ttft: float, itl: list[float], tokens: int, expected: int = 0) -> RequestOutput:
    """A successful request whose E2EL is TTFT plus its gaps, as a stream's would be."""
    return RequestOutput(
        prompt_len=10,
        expected_output_len=expected or tokens,
        output_tokens=tokens,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
    )


# -- metrics ---------------------------------------------------------------------------------


def test_percentile_interpolates_linearly_and_is_zero_when_empty() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([], 99) == 0.0


def test_tpot_excludes_the_first_token_and_is_none_for_one_token() -> None:
    out = output(0.100, [0.010, 0.020, 0.030], tokens=4)
    assert out.latency == pytest.approx(0.160)
    assert out.tpot == pytest.approx(0.020)  # (0.160 - 0.100) / 3
    assert output(0.1, [], tokens=1).tpot is None


def test_compute_metrics_known_answers() -> None:
    outputs = [
        output(0.100, [0.010, 0.010, 0.010], tokens=4),  # tpot 10 ms, e2el 130 ms
        output(0.300, [0.030, 0.030, 0.030], tokens=4, expected=8),  # tpot 30, e2el 390, short
        RequestOutput(prompt_len=10, expected_output_len=4, error="HTTP 500: boom"),
    ]
    m = compute_metrics(outputs, duration_s=2.0, slos={"ttft": 200, "tpot": 50})
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 20 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(14.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(100 + 0.99 * 200)
    assert m["mean_tpot_ms"] == pytest.approx(20.0)
    assert m["mean_itl_ms"] == pytest.approx(20.0)  # six gaps: three of 10, three of 30
    assert m["median_itl_ms"] == pytest.approx(20.0)
    assert m["p90_itl_ms"] == pytest.approx(30.0)
    assert m["mean_e2el_ms"] == pytest.approx(260.0)
    assert m["request_goodput"] == pytest.approx(0.5)  # only the first meets TTFT <= 200
    assert (m["min_output_len"], m["max_output_len"], m["num_short_outputs"]) == (4, 4, 1)


def test_goodput_needs_every_slo_and_none_without_slos() -> None:
    fast = output(0.050, [0.005] * 9, tokens=10)  # tpot 5 ms, e2el 95 ms
    assert meets_slos(fast, {"ttft": 60, "tpot": 5, "e2el": 100})
    assert not meets_slos(fast, {"ttft": 60, "tpot": 4.9})
    assert not meets_slos(fast, {"e2el": 90})
    assert compute_metrics([fast], 1.0)["request_goodput"] is None


def test_parse_goodput_messages() -> None:
    assert parse_goodput(["ttft:200", "tpot:50", "e2el:1000"]) == {
        "ttft": 200.0,
        "tpot": 50.0,
        "e2el": 1000.0,
    }
    with pytest.raises(ValueError, match=r"METRIC in \('ttft', 'tpot', 'e2el'\), not 'itl:5'"):
        parse_goodput(["itl:5"])
    with pytest.raises(ValueError, match="'fast' is not a number of ms"):
        parse_goodput(["ttft:fast"])
    with pytest.raises(ValueError, match="the SLO must be > 0 ms"):
        parse_goodput(["ttft:0"])


# -- requests, datasets and arrivals -----------------------------------------------------------


def test_request_body_sends_vllm_fields_only_with_ignore_eos() -> None:
    sample = SampleRequest([1, 2, 3], 3, 8)
    plain = request_body(ClientConfig("http://x", "m", "completions"), sample)
    assert plain["prompt"] == [1, 2, 3] and plain["max_tokens"] == 8
    assert plain["stream_options"] == {"include_usage": True}
    assert "ignore_eos" not in plain and "min_tokens" not in plain
    forced = request_body(ClientConfig("http://x", "m", "chat", ignore_eos=True), sample)
    assert forced["ignore_eos"] is True and forced["min_tokens"] == 8
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}, "chat") == ""
    assert chunk_text({"choices": [{"delta": {"content": "hi"}}]}, "chat") == "hi"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(str(default_model_dir(progress=False)))


def test_random_prompts_have_exact_lengths(tokenizer: Any) -> None:
    rng = np.random.default_rng(0)
    requests = random_requests(tokenizer, 20, 64, 16, 0.0, rng)
    assert all(len(r.prompt) == r.prompt_len == 64 and r.output_len == 16 for r in requests)
    special = set(tokenizer.all_special_ids)
    assert not any(t in special for r in requests for t in r.prompt)
    ranged = random_requests(tokenizer, 50, 100, 20, 0.5, rng)
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 for r in ranged)
    assert all(len(r.prompt) == r.prompt_len for r in ranged)
    texts = random_requests(tokenizer, 20, 32, 8, 0.0, rng, as_text=True)
    assert all(isinstance(r.prompt, str) for r in texts)
    encoded = [len(tokenizer.encode(r.prompt, add_special_tokens=False)) for r in texts]
    assert encoded == [r.prompt_len for r in texts]
    assert sum(n == 32 for n in encoded) >= 18  # the round trip settles almost always


def test_prefix_repetition_prompts_share_their_prefixes(tokenizer: Any) -> None:
    rng = np.random.default_rng(1)
    requests = prefix_repetition_requests(tokenizer, 6, 32, 2, 8, 4, 0.0, rng)
    prompts = [list(r.prompt) for r in requests]
    assert all(len(p) == 40 for p in prompts)
    assert prompts[0][:32] == prompts[2][:32] == prompts[4][:32]
    assert prompts[1][:32] == prompts[3][:32] != prompts[0][:32]
    assert prompts[0][32:] != prompts[2][32:]


def test_sharegpt_prompts_and_reply_lengths(tokenizer: Any, tmp_path: Path) -> None:
    reply = "The capital of France is Paris, a city on the Seine."
    conversations = [
        {"conversations": [{"from": "human", "value": "What is the capital of France?"},
                           {"from": "gpt", "value": reply}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
    ]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    [request] = sharegpt_requests(path, 1, tokenizer, np.random.default_rng(0))
    assert request.prompt == "What is the capital of France?"
    assert request.output_len == len(tokenizer.encode(reply))
    with pytest.raises(DatasetError, match="has 1 usable conversations, fewer than 2"):
        sharegpt_requests(path, 2, tokenizer, np.random.default_rng(0))


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrival_gaps_have_mean_one_over_rate(burstiness: float) -> None:
    delays = arrival_delays(20000, rate=8.0, burstiness=burstiness, seed=0)
    assert delays.mean() == pytest.approx(1 / 8, rel=0.05)
    # gamma's coefficient of variation is 1/sqrt(shape): burstier arrivals vary more
    assert delays.std() / delays.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)
    assert not arrival_delays(5, float("inf"), 1.0, 0).any()


# -- end to end ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    model = save_tiny(tmp_path_factory.mktemp("bench-tiny"), "llama")
    server = start_server(model)
    try:
        yield server, model
    finally:
        server.stop()


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(PERF / "bench_serve.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_a_short_run_against_trillm_serve(server: tuple[Server, Path], tmp_path: Path) -> None:
    srv, model = server
    result_path = tmp_path / "result.json"
    run = bench(
        "--base-url", srv.base_url, "--tokenizer", str(model), "--num-prompts", "6",
        "--random-input-len", "16", "--random-output-len", "8", "--max-concurrency", "3",
        "--request-rate", "50", "--num-warmups", "1", "--ignore-eos",
        "--goodput", "ttft:60000", "--save-result", str(result_path),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "Serving Benchmark Result" in run.stdout and "Median TTFT (ms):" in run.stdout
    result = json.loads(result_path.read_text())
    for key in ("completed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "request_goodput",
                "input_lens", "output_lens", "ttfts", "itls", "e2els", "errors"):  # fmt: skip
        assert key in result, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            assert result[f"{stat}_{metric}_ms"] > 0
    assert result["model"] == "tiny"  # the default: the first id of /v1/models
    assert result["completed"] == 6 and result["errors"] == [""] * 6
    assert result["output_lens"] == [8] * 6 and result["input_lens"] == [16] * 6
    assert result["total_output_tokens"] == 48 and result["num_short_outputs"] == 0
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    # a random model's token may end mid-character: its text waits for the next chunk
    assert all(1 <= len(gaps) <= 7 for gaps in result["itls"])


def test_failed_requests_are_counted_not_raised(server: tuple[Server, Path]) -> None:
    srv, model = server
    run = bench(
        "--base-url", srv.base_url, "--tokenizer", str(model), "--model", "no-such-model",
        "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "Failed requests:                                           2" in run.stdout
    assert "request 0 failed: HTTP 404" in run.stdout


def test_plot_writes_a_png_of_the_run(server: tuple[Server, Path], tmp_path: Path) -> None:
    srv, model = server
    plot = tmp_path / "run.png"
    run = bench(
        "--base-url", srv.base_url, "--tokenizer", str(model), "--num-prompts", "4",
        "--random-input-len", "8", "--random-output-len", "4", "--max-concurrency", "2",
        "--ignore-eos", "--plot", str(plot),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- which tokenizer, without --tokenizer ----------------------------------------------------


@contextmanager
def models_server(body: bytes) -> Iterator[str]:
    """A real HTTP server whose `GET /v1/models` answers `body` (anything else: 404 or 501)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = self.path == "/v1/models"
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body) if found else 0))
            self.end_headers()
            if found:
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def trillm_models(name: str) -> bytes:
    """What trillm's `GET /v1/models` answers when it serves `name` (its own encoder)."""
    return models_response([name], max_model_len=2048)


def other_models(name: str, owned_by: str) -> bytes:
    card = {"id": name, "object": "model", "created": 0, "owned_by": owned_by}
    return json.dumps({"object": "list", "data": [card]}).encode()


def test_trillm_serving_the_default_model_names_its_directory() -> None:
    with models_server(trillm_models(DEFAULT_MODEL_NAME)) as url:
        found = find_tokenizer(DEFAULT_MODEL_NAME, url, None)
    assert found == str(default_model_dir(progress=False))
    assert (Path(found) / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    ("body", "model"),
    [
        (other_models(DEFAULT_MODEL_NAME, "vllm"), DEFAULT_MODEL_NAME),  # not trillm
        (trillm_models("my-model"), "my-model"),  # trillm, but not the built-in model
        (trillm_models("my-model"), DEFAULT_MODEL_NAME),  # trillm does not serve that name
        (b"not json", DEFAULT_MODEL_NAME),
    ],
)
def test_other_servers_and_models_name_no_tokenizer(body: bytes, model: str) -> None:
    with models_server(body) as url:
        assert find_tokenizer(model, url, None) is None


def test_a_server_that_is_down_names_no_tokenizer() -> None:
    assert find_tokenizer(DEFAULT_MODEL_NAME, f"http://127.0.0.1:{free_port()}", None) is None


def test_a_model_name_that_is_a_gguf_file_or_a_directory_is_its_own_tokenizer(
    tmp_path: Path, tokenizer: Any
) -> None:
    down = f"http://127.0.0.1:{free_port()}"  # a local path needs no server
    gguf = str(find_default_gguf())
    assert find_tokenizer(gguf, down, None) == gguf
    assert find_tokenizer(str(tmp_path), down, None) == str(tmp_path)
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"")
    assert find_tokenizer(str(not_gguf), down, None) is None
    text = "The capital of France is Paris."
    assert load_tokenizer(gguf).encode(text) == tokenizer.encode(text)


def test_the_missing_tokenizer_message_names_the_model_and_the_server() -> None:
    error = TokenizerNotFoundError("random", "my-model", "http://host:8000")
    assert str(error) == (
        "--dataset random needs a tokenizer to count tokens; model 'my-model' is not a local "
        "directory or .gguf file, and the server at http://host:8000 does not list it as "
        "trillm's built-in model: pass --tokenizer PATH (a directory with tokenizer.json, "
        "a .gguf file, or a Hugging Face hub id)"
    )


def test_bench_serve_without_tokenizer_stops_with_what_to_pass(
    server: tuple[Server, Path],
) -> None:
    srv, _ = server  # serves a directory under the name "tiny": no tokenizer to find
    run = bench("--base-url", srv.base_url, "--num-prompts", "1")
    assert run.returncode == 2
    assert run.stderr == f"bench_serve: {TokenizerNotFoundError('random', 'tiny', srv.base_url)}\n"


def test_bench_serve_takes_the_default_models_tokenizer_from_a_trillm_server() -> None:
    with models_server(trillm_models(DEFAULT_MODEL_NAME)) as url:
        run = bench(
            "--base-url", url, "--num-prompts", "1", "--random-input-len", "4",
            "--random-output-len", "2",
        )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert f"Model: {DEFAULT_MODEL_NAME}" in run.stdout
    assert "request 0 failed: HTTP 501" in run.stdout  # the fake serves only /v1/models
