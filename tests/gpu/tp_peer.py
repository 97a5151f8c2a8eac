"""One tensor-parallel rank for the TP tests: ``python tp_peer.py MODEL RANK WORLD INIT``.

Runs the same driver as the test on a `Worker`; rank 0 prints the generated tokens as JSON.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.gpu.driver import Driver, DriverRequest
from trillm.gpu import Worker, WorkerConfig

ROOT = Path(__file__).resolve().parents[2]

PROMPTS = [list(range(50, 50 + n)) for n in (3, 17, 9, 1, 30)]


def generate(worker: Worker) -> list[list[int]]:
    worker.init_device()
    worker.load_model()
    blocks = min(worker.num_available_kv_blocks(), 64)
    worker.init_kv_cache(blocks)
    requests = [DriverRequest(i, p, max_tokens=10) for i, p in enumerate(PROMPTS)]
    Driver(worker.runner, blocks, chunk=7).run(requests)
    return [r.output for r in requests]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def generate_tp2(model: Path, *, timeout: float = 120) -> list[list[int]]:
    """`generate` on two gloo ranks, each this script in its own process; rank 0's tokens."""
    init = f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(model), str(rank), "2", init],
            stdout=subprocess.PIPE,
            env=env,
        )
        for rank in range(2)
    ]
    try:
        out, _ = procs[0].communicate(timeout=timeout)
        assert procs[1].wait(timeout=60) == 0
        assert procs[0].returncode == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    tokens: list[list[int]] = json.loads(out)
    return tokens


if __name__ == "__main__":
    model, rank, world, init = sys.argv[1:]
    config = WorkerConfig(
        model, device="cpu", dtype="float32", block_size=8, kv_cache_bytes=1 << 24
    )
    worker = Worker(config, rank=int(rank), world_size=int(world), dist_init_method=init)
    try:
        outputs = generate(worker)
    finally:
        worker.shutdown()
    if int(rank) == 0:
        print(json.dumps(outputs), flush=True)
