"""Workers: start-up order, KV sizing, and tensor parallelism over gloo with real processes."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from trillm.gpu import Worker, WorkerConfig
from trillm.gpu.worker._worker import KVCacheTooSmallError, keep_activations_in_heap

from .tp_peer import generate, generate_tp2


# At TP 2 Llama 3 (RoPE scaling, its checkpoint in shards) takes Llama's sharding: test-slow
# only. Llama (tied head) and Qwen2 (untied head, q/k/v biases split) stay in `make test`.
@pytest.mark.parametrize(
    "tiny_model_dir",
    ["llama", pytest.param("llama3", marks=pytest.mark.slow), "qwen2"],
    indirect=True,
)
def test_tensor_parallel_2_gives_the_same_greedy_tokens_as_1(tiny_model_dir: Path) -> None:
    config = WorkerConfig(
        str(tiny_model_dir), device="cpu", dtype="float32", block_size=8, kv_cache_bytes=1 << 24
    )
    assert generate_tp2(tiny_model_dir) == generate(Worker(config))


def test_kv_blocks_follow_the_cpu_budget(tiny_model_dir: Path) -> None:
    worker = Worker(WorkerConfig(str(tiny_model_dir), device="cpu", kv_cache_bytes=1 << 20))
    worker.init_device()
    worker.load_model()
    per_block = worker.runner.kv_bytes_per_block()
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4  # K+V, layers, block, kv heads, head_dim, f32
    assert worker.num_available_kv_blocks() == (1 << 20) // per_block
    worker.profile_run()  # leaves nothing behind
    assert not worker.runner.inputs.row_of and not worker.runner.kv_caches


def test_sleep_frees_the_kv_cache_and_wake_up_brings_back_its_size(tiny_model_dir: Path) -> None:
    worker = Worker(WorkerConfig(str(tiny_model_dir), device="cpu", kv_cache_bytes=1 << 20))
    worker.init_device()
    worker.load_model()
    with pytest.raises(RuntimeError, match=r"^wake_up\(\) without sleep\(\)$"):
        worker.wake_up()
    worker.init_kv_cache(5)
    worker.sleep(2)  # level 2 on CPU is level 1: the weights stay
    assert worker.runner.kv_caches == []
    with pytest.raises(RuntimeError, match=r"^sleep\(\) without a KV cache \(asleep already"):
        worker.sleep(1)
    worker.wake_up()
    assert [k.shape[0] for k, _ in worker.runner.kv_caches] == [5, 5]


def test_a_kv_budget_below_one_block_says_what_to_change(tiny_model_dir: Path) -> None:
    worker = Worker(WorkerConfig(str(tiny_model_dir), device="cpu", kv_cache_bytes=100))
    worker.init_device()
    worker.load_model()
    with pytest.raises(
        KVCacheTooSmallError,
        match="needs 8192 bytes on rank 0 and the budget is 100 bytes; raise kv_cache_bytes",
    ):
        worker.num_available_kv_blocks()


def test_start_up_logs_each_phase_and_the_total(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line per phase, in the order they run, then the total: the figures that say why one
    start-up took longer than another."""
    worker = Worker(WorkerConfig(str(tiny_model_dir), device="cpu", kv_cache_bytes=1 << 20))
    worker.init_device()
    worker.load_model()
    worker.init_kv_cache(worker.num_available_kv_blocks())
    lines = [line for line in capsys.readouterr().err.splitlines() if "start-up:" in line]
    phases = [line.split("start-up: ", 1)[1].rsplit(":", 1)[0] for line in lines]
    assert phases[0].startswith("device and process group")
    if platform.libc_ver()[0] == "glibc":
        assert phases[0].endswith("(malloc: heap up to 32 MiB blocks)")
    assert phases[1:3] == [
        "checkpoint opened",
        "model built and weights loaded",
    ]
    assert phases[3].startswith("C decode step (")
    if worker.runner.cpu_step is not None:  # cpu_decode "auto": timed, or read from the cache
        timed = {"decode paths measured", "decode paths read from the cache"}
        assert len(timed.intersection(phases[4:6])) == 1  # after the oneDNN packing, if any
    assert phases[-2].startswith("KV cache of ") and phases[-1].startswith("worker ready in")
    seconds = [float(line.rsplit(" ", 2)[-2]) for line in lines]
    assert seconds[-1] >= sum(seconds[:-1]) - 0.01  # the total holds every phase


MALLOC_CHILD = """
import ctypes, sys
import torch
from trillm.gpu.worker._worker import keep_activations_in_heap
FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS.split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
if sys.argv[1] == "heap":
    assert keep_activations_in_heap()
before = libc.mallinfo2().hblkhd
x = torch.empty(8 << 20, dtype=torch.uint8)
print("mapped" if libc.mallinfo2().hblkhd - before >= 8 << 20 else "heap")
"""


@pytest.mark.parametrize("mode", ["mapped", "heap"])
def test_a_cpu_worker_serves_activations_from_the_heap(mode: str) -> None:
    """glibc maps an 8 MiB tensor of its own by default, and takes it from the heap (whose
    freed pages the next step reuses) after `keep_activations_in_heap`."""
    if platform.libc_ver()[0] != "glibc" or not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("glibc 2.33 or later")
    command = [sys.executable, "-c", MALLOC_CHILD, mode]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == mode


def test_without_glibc_malloc_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    class Musl:
        def mallopt(self, param: int, value: int) -> int:
            raise AssertionError("mallopt called on a libc that is not glibc")

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Musl())
    assert not keep_activations_in_heap()
