"""MultiprocExecutor: real worker processes and shared memory; every death reported by cause."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import msgspec
import pytest
import trio

from trillm.engine.core._errors import WorkerDiedError
from trillm.engine.core.executor._executor import Executor, UniprocExecutor
from trillm.engine.core.executor._executor_multiproc import MultiprocExecutor
from trillm.gpu import ModelRunner, RunnerOutput, StepBatch, WorkerConfig
from trillm.gpu.cpu._tiles import tiled_kernels

from ...gpu.conftest import save_tiny
from ...gpu.driver import Driver, DriverRequest
from ...gpu.tp_peer import PROMPTS

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama")


def worker_config(model: Path, **kw: object) -> WorkerConfig:
    # cpu_decode "c": the uniproc's decode word below is the C step's on any machine
    options: dict[str, object] = dict(device="cpu", dtype="float32", block_size=8, cpu_decode="c")
    return WorkerConfig(str(model), **{**options, "kv_cache_bytes": 1 << 24, **kw})  # type: ignore[arg-type]


class Stepper:
    """What `Driver` needs of a runner, over an executor; `on_step` runs before each step."""

    def __init__(
        self, executor: Executor, block_size: int, on_step: Callable[[int], None] | None = None
    ) -> None:
        self.executor = executor
        self.block_size = block_size
        self.on_step = on_step

    def execute(self, batch: StepBatch) -> RunnerOutput:
        if self.on_step is not None:
            self.on_step(batch.step)
        return self.executor.execute(batch)


def generate(
    executor: Executor, num_blocks: int, on_step: Callable[[int], None] | None = None
) -> list[list[int]]:
    """Greedy tokens for `PROMPTS`, prefilled in chunks of 7 (steps 0-4), then decoded."""
    requests = [DriverRequest(i, p, max_tokens=10) for i, p in enumerate(PROMPTS)]
    stepper = Stepper(executor, 8, on_step)
    Driver(cast(ModelRunner, stepper), min(num_blocks, 64), chunk=7).run(requests)
    return [r.output for r in requests]


def our_segments() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"trillm-{os.getpid()}-")]


def assert_no_process(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.fixture(autouse=True)
def leaves_no_segment() -> Iterator[None]:
    yield
    assert our_segments() == []


def test_tensor_parallel_2_gives_the_uniproc_greedy_tokens(model_dir: Path) -> None:
    config = worker_config(model_dir)
    uniproc = UniprocExecutor(config)
    uniproc_blocks = uniproc.initialize()
    expected = generate(uniproc, uniproc_blocks)
    uniproc.shutdown()
    with MultiprocExecutor(config, 2) as executor:
        num_blocks = executor.initialize()
        assert num_blocks == 2 * uniproc_blocks  # each rank holds half the KV heads
        assert executor.model_config == uniproc.model_config
        assert executor.max_model_len == uniproc.max_model_len == 512
        assert executor.kernels is not None and uniproc.kernels is not None
        # rank 0's, through its ring; only the decode path differs (no C step at TP 2)
        assert executor.kernels.decode.startswith("torch (tensor parallel")
        assert uniproc.kernels.decode.startswith("c (" if tiled_kernels() else "torch (")
        same = msgspec.structs.replace(executor.kernels, decode=uniproc.kernels.decode)
        assert same == uniproc.kernels
        assert generate(executor, num_blocks) == expected
        # Sleep and wake-up reach every rank (level 2: weights to host memory and back).
        for level in (1, 2):
            executor.sleep(level)
            executor.wake_up()
        assert generate(executor, num_blocks) == expected
        pids = executor.pids
    assert executor.returncodes == [0, 0]
    assert_no_process(pids)


def test_an_exception_in_a_rank_names_the_rank_and_its_traceback(model_dir: Path) -> None:
    with MultiprocExecutor(worker_config(model_dir, inject_fault="forward:1:2"), 2) as executor:
        num_blocks = executor.initialize()
        with pytest.raises(
            WorkerDiedError,
            match=r"^worker rank 1 raised InjectedFault: injected fault in "
            r"LlamaForCausalLM\.forward \(test hook\)",
        ) as info:
            generate(executor, num_blocks)
        error = info.value.error
        assert (error.where, error.exc_type) == ("worker rank 1", "InjectedFault")
        assert ", in forward\n" in error.traceback
        assert "InjectedFault: injected fault in LlamaForCausalLM.forward" in error.traceback
        with pytest.raises(WorkerDiedError, match=r"^worker rank 1 raised InjectedFault"):
            executor.execute(StepBatch(99))  # later calls fail at once, with the same cause


# Rank 1's death at TP 2 is also test_engine_process's SIGKILL case (in `make test`).
@pytest.mark.parametrize("victim", [pytest.param(1, marks=pytest.mark.slow), 0])
def test_a_killed_rank_is_reported_within_a_second(model_dir: Path, victim: int) -> None:
    """Rank 1's death breaks rank 0's collective (rank 0 then fails too: a consequence, not
    the cause); rank 0's death leaves the executor waiting on a ring no one will write."""
    killed_at = 0.0

    def kill_mid_decode(step: int) -> None:
        nonlocal killed_at
        if step == 7:
            killed_at = time.monotonic()
            os.kill(executor.pids[victim], signal.SIGKILL)

    with MultiprocExecutor(worker_config(model_dir), 2) as executor:
        num_blocks = executor.initialize()
        with pytest.raises(WorkerDiedError, match=f"^worker rank {victim} was killed by signal 9$"):
            generate(executor, num_blocks, kill_mid_decode)
        elapsed = time.monotonic() - killed_at
        assert executor.returncodes[victim] == -signal.SIGKILL
        pids = executor.pids
    print(f"SIGKILL of rank {victim} -> WorkerDiedError: {elapsed * 1e3:.1f} ms")
    assert elapsed < 1.0
    assert_no_process(pids)


@pytest.mark.parametrize(
    ("model", "kv_cache_bytes", "cause"),
    [
        (
            "missing",
            1 << 24,
            r"ModelConfigError: model '.*missing' does not exist: give a Hugging Face",
        ),
        pytest.param(  # the same path as a missing model; the error: tests/gpu/test_worker.py
            None,
            100,
            r"KVCacheTooSmallError: the KV cache does not fit: one block of 8 tokens",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_rank_that_fails_to_load_names_itself_and_the_cause(
    model_dir: Path, tmp_path: Path, model: str | None, kv_cache_bytes: int, cause: str
) -> None:
    path = model_dir if model is None else tmp_path / model
    config = worker_config(path, kv_cache_bytes=kv_cache_bytes)
    with MultiprocExecutor(config, 2) as executor:
        with pytest.raises(WorkerDiedError, match=rf"^worker rank [01] raised {cause}") as info:
            executor.initialize()
        assert info.value.error.where in ("worker rank 0", "worker rank 1")
        pids = executor.pids
    assert_no_process(pids)


def test_a_rank_that_dies_before_attaching_is_reported(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "executable", "/bin/false")  # every "worker" exits at once, code 1
    with pytest.raises(WorkerDiedError, match=r"^worker rank [01] exited with code 1$"):
        MultiprocExecutor(worker_config(model_dir), 2)


def test_shutdown_is_idempotent_and_leaves_nothing_behind(model_dir: Path) -> None:
    executor = MultiprocExecutor(worker_config(model_dir), 2)  # never initialised
    pids = executor.pids
    executor.shutdown()
    executor.shutdown()
    assert executor.returncodes == [0, 0]
    assert_no_process(pids)
    with pytest.raises(trio.ClosedResourceError, match=r"^the executor was shut down$"):
        executor.execute(StepBatch(0))


HOST = """
import json, sys
from trillm.engine.core.executor._executor_multiproc import MultiprocExecutor
from trillm.gpu import WorkerConfig
executor = MultiprocExecutor(WorkerConfig(sys.argv[1], device="cpu", kv_cache_bytes=1 << 24), 2)
executor.initialize()
print(json.dumps(executor.pids), flush=True)
sys.stdin.read()  # until the test kills us
"""


def test_workers_die_with_a_killed_executor_process(model_dir: Path) -> None:
    host = subprocess.Popen(
        [sys.executable, "-c", HOST, str(model_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        assert host.stdout is not None
        pids = json.loads(host.stdout.readline())
        exits = select.poll()
        pidfds = [os.pidfd_open(pid) for pid in pids]
        for fd in pidfds:
            exits.register(fd, select.POLLIN)
        host.kill()
        assert host.wait(timeout=10) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        alive = set(pidfds)
        while alive:
            left = deadline - time.monotonic()
            assert left > 0, "a worker outlived its executor by 10 s"
            for fd, _ in exits.poll(left * 1000):
                exits.unregister(fd)
                alive.discard(fd)
        for fd in pidfds:
            os.close(fd)
        stale = [n for n in os.listdir("/dev/shm") if n.startswith(f"trillm-{host.pid}-")]
        assert stale == []
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
        for stream in (host.stdin, host.stdout):
            if stream is not None:
                stream.close()
