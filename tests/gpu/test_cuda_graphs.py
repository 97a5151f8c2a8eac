"""The decode-graph path on CPU: static, padded buffers give the eager path's tokens.

Off CUDA `DecodeGraphs` records no graph but runs the forward over the same static buffers
a graph would replay (padding rows with slot -1 and context 0), so what the graph sees is
tested here; `test_cuda.py` replays real graphs on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trillm.gpu import WorkerConfig

from .conftest import make_runner
from .driver import Driver, DriverRequest

pytestmark = pytest.mark.timeout(300)


def test_capture_sizes_are_vllms() -> None:
    sizes = WorkerConfig("m", max_num_seqs=256).cuda_graph_sizes()
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 256 and len(sizes) == 35
    assert WorkerConfig("m", max_num_seqs=1000).cuda_graph_sizes()[-1] == 512
    assert WorkerConfig("m", max_num_seqs=5).cuda_graph_sizes() == (1, 2, 4, 5)
    assert WorkerConfig("m", enforce_eager=True).cuda_graph_sizes() == ()


SLOW = pytest.mark.slow


# The padding is the runner's, not the family's: `make test` pads 3 rows to 4 on the tiny
# Llama and 5 to 6 on Qwen2; every family with both sizes is in `make test-slow`.
@pytest.mark.parametrize(
    ("tiny_model_dir", "num_requests"),
    [
        ("llama", 3),
        pytest.param("llama", 5, marks=SLOW),
        pytest.param("llama3", 3, marks=SLOW),
        pytest.param("llama3", 5, marks=SLOW),
        pytest.param("qwen2", 3, marks=SLOW),
        ("qwen2", 5),
    ],
    indirect=["tiny_model_dir"],
)
def test_padded_static_buffers_give_the_eager_tokens(
    tiny_model_dir: Path, num_requests: int
) -> None:
    prompts = [list(range(60 + 7 * i, 60 + 7 * i + 3 + 5 * i)) for i in range(num_requests)]
    runs = {}
    for graphs in (False, True):
        runner = make_runner(tiny_model_dir, attention_backend="triton", max_num_seqs=6)
        if graphs:
            line = runner.capture_cuda_graphs(off_cuda=True)
            assert line.startswith("cuda graphs: 4 decode batch sizes (1, 2, 4, 6)")
        requests = [DriverRequest(i, p, max_tokens=10) for i, p in enumerate(prompts)]
        Driver(runner, 64).run(requests)
        runs[graphs] = [r.output for r in requests]
        if graphs:
            assert runner.graphs is not None and runner.graphs.num_runs >= 9
    assert runs[True] == runs[False]


def test_graphs_need_the_triton_backend(tiny_model_dir: Path) -> None:
    runner = make_runner(tiny_model_dir, attention_backend="torch")
    assert "use --attention-backend triton" in runner.capture_cuda_graphs(off_cuda=True)
    assert runner.graphs is None
    eager = make_runner(tiny_model_dir, attention_backend="triton", enforce_eager=True)
    assert eager.capture_cuda_graphs(off_cuda=True) == "cuda graphs: none (--enforce-eager)"


# Each family's fused forward is test_fused_kernels' (bit for bit); over the padded buffers
# `make test` runs the tiny Llama.
@pytest.mark.parametrize(
    "tiny_model_dir",
    ["llama", pytest.param("llama3", marks=SLOW), pytest.param("qwen2", marks=SLOW)],
    indirect=True,
)
def test_the_fused_kernels_over_padded_buffers_give_their_eager_tokens(
    tiny_model_dir: Path,
) -> None:
    """CUDA's graphs run the fused kernels (`_fused_kernels`): over the padded static buffers
    (slot -1 rows: the rotary kernel writes no K/V) they give the fused eager path's tokens."""
    prompts = [list(range(60 + 7 * i, 60 + 7 * i + 3 + 5 * i)) for i in range(3)]
    runs = {}
    for graphs in (False, True):
        runner = make_runner(tiny_model_dir, attention_backend="triton", max_num_seqs=4)
        assert runner.model is not None
        runner.model.use_fused()
        if graphs:
            runner.capture_cuda_graphs(off_cuda=True)
        requests = [DriverRequest(i, p, max_tokens=4) for i, p in enumerate(prompts)]
        Driver(runner, 64).run(requests)
        runs[graphs] = [r.output for r in requests]
    assert runs[True] == runs[False]
