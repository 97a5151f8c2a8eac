"""Workers: start-up order, KV sizing, and tensor parallelism over gloo with real processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trillm.gpu import Worker, WorkerConfig
from trillm.gpu._worker import KVCacheTooSmallError

from .tp_peer import generate

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_tensor_parallel_2_gives_the_same_greedy_tokens_as_1(tiny_model_dir: Path) -> None:
    config = WorkerConfig(
        str(tiny_model_dir), device="cpu", dtype="float32", block_size=8, kv_cache_bytes=1 << 24
    )
    single = generate(Worker(config))
    init = f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests/gpu/tp_peer.py"),
                str(tiny_model_dir),
                str(rank),
                "2",
                init,
            ],
            stdout=subprocess.PIPE,
            env=env,
        )
        for rank in range(2)
    ]
    try:
        out, _ = procs[0].communicate(timeout=120)
        assert procs[1].wait(timeout=60) == 0
        assert procs[0].returncode == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert json.loads(out) == single


def test_kv_blocks_follow_the_cpu_budget(tiny_model_dir: Path) -> None:
    worker = Worker(WorkerConfig(str(tiny_model_dir), device="cpu", kv_cache_bytes=1 << 20))
    worker.init_device()
    worker.load_model()
    per_block = worker.runner.kv_bytes_per_block()
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4  # K+V, layers, block, kv heads, head_dim, f32
    assert worker.num_available_kv_blocks() == (1 << 20) // per_block
    worker.runner.profile_run()  # leaves nothing behind
    assert not worker.runner.inputs.row_of


def test_a_kv_budget_below_one_block_says_what_to_change(tiny_model_dir: Path) -> None:
    worker = Worker(WorkerConfig(str(tiny_model_dir), device="cpu", kv_cache_bytes=100))
    worker.init_device()
    worker.load_model()
    with pytest.raises(
        KVCacheTooSmallError,
        match="needs 8192 bytes on rank 0 and the budget is 100 bytes; raise kv_cache_bytes",
    ):
        worker.num_available_kv_blocks()
