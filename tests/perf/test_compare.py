"""perf/compare.py: the prompt FLOPs (a known answer), the matmul rates, the ratio report."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from trillm.gpu.cpu._cpu_linear import packed_linear_available

PERF = Path(__file__).resolve().parents[2] / "perf"
sys.path.insert(0, str(PERF))  # perf/ is scripts, not a package

from compare import ServerStartError, matmul_rates, prompt_gflops, report, serving  # noqa: E402


def test_prompt_flops_count_linears_causal_attention_and_one_head_row() -> None:
    config = {
        "hidden_size": 4,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 8,
        "vocab_size": 10,
    }
    # per layer: q 4x4, k and v 4x2 each, o 4x4, gate/up/down 3 x 4x8 -> 144 weights
    linear = 2 * 3 * 144 * 2  # 2 FLOPs per weight, 3 tokens, 2 layers
    attention = 2 * 2 * 4 * (1 + 2 + 3) * 2  # q.k and p.v, 4 query dims, causal 3 tokens
    head = 2 * 4 * 10  # the last token's logits only
    assert prompt_gflops(config, 3) * 1e9 == pytest.approx(linear + attention + head)


def test_matmul_rates_measure_both_libraries() -> None:
    rates = matmul_rates(1)
    assert rates["mkl"] > 1.0  # GFLOP/s: any machine that runs the tests does more
    if packed_linear_available(torch.float32):  # x86 CPU builds of torch carry oneDNN
        assert rates["onednn"] > 1.0
    else:
        assert rates["onednn"] == 0.0


def test_report_prints_ratios_and_the_floor() -> None:
    ours = {1: _result(40.0, 100.0), 32: _result(300.0, 2000.0)}
    peer = {1: _result(20.0, 200.0), 32: _result(60.0, 12000.0)}
    lines = report(ours, peer, floor_ms=50.0)
    ratios = next(i for i, line in enumerate(lines) if line.startswith("trillm / peer"))
    assert lines[ratios + 1].split()[:3] == ["1", "2.000", "0.500"]
    assert lines[ratios + 2].split()[:3] == ["32", "5.000", "0.167"]
    assert "trillm 100.0 ms = 2.00x floor, peer 200.0 ms = 4.00x" in lines[-2]


def _result(tok_s: float, ttft: float) -> dict[str, float]:
    return {
        "output_throughput": tok_s,
        "median_ttft_ms": ttft,
        "p99_ttft_ms": ttft * 1.5,
        "median_tpot_ms": 20.0,
        "p99_tpot_ms": 25.0,
        "total_output_tokens": 640,
        "completed": 10,
    }


def test_a_server_that_dies_at_start_up_is_a_start_error_naming_it(tmp_path: Path) -> None:
    """What `main` catches to report that pairing as not run and still run the others (a
    peer that cannot start on this CPU: llama.cpp's Q4_1 server died at start-up on an AMX
    machine, perf/README.md)."""
    command = [sys.executable, "-c", "print('loading'); import sys; sys.exit(3)"]
    died = r"peer exited during start-up \(status 3\).*loading"
    with (
        pytest.raises(ServerStartError, match=died),
        serving("peer", command, 1, tmp_path / "log", timeout=30),
    ):
        pass
