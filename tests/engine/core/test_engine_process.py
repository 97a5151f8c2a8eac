"""The engine process end to end through real rings, driven by the test client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trillm.engine.client.engines._launch import EngineStartError
from trillm.engine.protocol import _messages as P
from trillm.engine.protocol._config import EngineConfig
from trillm.gpu import WorkerConfig

from ...gpu.conftest import make_runner, save_tiny
from ...gpu.driver import Driver, DriverRequest
from ...procs import children, is_dead
from .ring_client import GREEDY, EngineClient

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = [list(range(40 + i, 40 + i + n)) for i, n in enumerate((5, 33, 17, 1, 48, 9, 26, 12))]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("engine-tiny"), "llama")


def engine_config(model: Path, **kw: object) -> EngineConfig:
    worker = WorkerConfig(
        str(model),
        device="cpu",
        dtype="float32",
        block_size=16,
        max_num_batched_tokens=64,
        kv_cache_bytes=1 << 24,
        **{k: v for k, v in kw.items() if k in ("inject_fault", "max_num_seqs")},  # type: ignore[arg-type]
    )
    rest = {k: v for k, v in kw.items() if k not in ("inject_fault", "max_num_seqs")}
    return EngineConfig(worker=worker, **rest)  # type: ignore[arg-type]


@pytest.fixture
def client_for(tiny_dir: Path) -> Iterator[object]:
    clients: list[EngineClient] = []

    def start(**kw: object) -> EngineClient:
        client = EngineClient(engine_config(tiny_dir, **kw))
        clients.append(client)
        return client

    yield start
    for client in clients:
        client.close()


def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"trillm-{os.getpid()}-")}


def test_greedy_tokens_equal_the_runner_for_8_concurrent_prompts(
    client_for: object, tiny_dir: Path
) -> None:
    client: EngineClient = client_for()  # type: ignore[operator]
    for rnum, prompt in enumerate(PROMPTS):
        client.add(rnum, prompt, max_tokens=10)
    client.run_until(lambda: len(client.finish) == len(PROMPTS))
    runner = make_runner(tiny_dir, num_blocks=128, block_size=16)
    reference = [DriverRequest(i, p, 10, GREEDY) for i, p in enumerate(PROMPTS)]
    Driver(runner, 128).run(reference)
    assert {r: client.tokens[r] for r in range(8)} == {r.rnum: r.output for r in reference}
    assert set(client.finish.values()) == {2}  # LENGTH


def test_a_repeated_prompt_hits_the_prefix_cache(client_for: object) -> None:
    client: EngineClient = client_for()  # type: ignore[operator]
    prompt = list(range(500, 540))  # 40 tokens: two full blocks of 16
    client.add(1, prompt, max_tokens=3)
    client.run_until(lambda: 1 in client.finish)
    client.add(2, prompt, max_tokens=3)
    client.run_until(lambda: 2 in client.finish)
    assert client.cached.get(1, 0) == 0
    assert client.cached[2] == 32
    assert client.tokens[1] == client.tokens[2]


def test_abort_mid_decode_frees_the_blocks(client_for: object) -> None:
    client: EngineClient = client_for()  # type: ignore[operator]
    client.add(7, list(range(100, 130)), max_tokens=400)
    client.run_until(lambda: len(client.tokens[7]) >= 3)
    client.abort([7, 12345])  # an unknown rnum is harmless
    client.run_until(lambda: 7 in client.finish)
    assert client.finish[7] == 3  # ABORT
    client.utility(1, "stats")
    client.run_until(lambda: any(e.call_id == 1 for e in client.events))
    stats = next(e for e in client.events if e.call_id == 1).result
    assert isinstance(stats, dict)
    assert stats["num_running"] == 0 and stats["kv_usage"] == 0.0


# `make test` keeps this DEAD record through the client (test_async_llm's injected forward
# exception, split) and through the server, with its exit code and swept names
# (faults/test_worker_faults.py's TP 1 case).
@pytest.mark.slow
def test_an_exception_in_forward_yields_dead_naming_the_function(client_for: object) -> None:
    client: EngineClient = client_for(inject_fault="forward:0:2")  # type: ignore[operator]
    client.add(1, list(range(10, 30)), max_tokens=20)
    with pytest.raises(AssertionError, match="the engine died"):
        client.run_until(lambda: 1 in client.finish)
    assert client.dead is not None
    assert client.dead.where == "worker rank 0"
    assert client.dead.exc_type == "InjectedFault"
    assert "LlamaForCausalLM.forward" in client.dead.message
    assert "in forward" in client.dead.traceback
    assert client.wait_exit() == 1
    assert not shm_names()


def test_shutdown_drain_finishes_running_requests_then_exits_0(client_for: object) -> None:
    client: EngineClient = client_for()  # type: ignore[operator]
    client.add(1, list(range(60, 70)), max_tokens=15)
    client.run_until(lambda: len(client.tokens[1]) >= 1)
    client.shutdown("drain", timeout=30)
    client.add(2, [1, 2, 3], max_tokens=5)  # refused: draining admits nothing new
    assert client.wait_exit() == 0
    assert client.finish == {1: 2, 2: 3}
    assert len(client.tokens[1]) == 15 and client.tokens[2] == []
    assert not shm_names()


def test_shutdown_abort_finishes_everything_with_abort(client_for: object) -> None:
    client: EngineClient = client_for()  # type: ignore[operator]
    for rnum in range(3):
        client.add(rnum, list(range(80, 90)), max_tokens=500)
    client.run_until(lambda: all(len(client.tokens[r]) >= 1 for r in range(3)))
    client.shutdown("abort")
    assert client.wait_exit() == 0
    assert client.finish == {0: 3, 1: 3, 2: 3}


def test_a_missing_model_fails_start_up_with_the_cause(tmp_path: Path) -> None:
    with pytest.raises(EngineStartError, match="does not exist"):
        EngineClient(engine_config(tmp_path / "no-such-model"))
    assert not shm_names()


@pytest.mark.slow  # the same parent-death signal: faults/test_frontend_death.py's [tp1] case
def test_the_engine_exits_when_its_parent_dies(tiny_dir: Path) -> None:
    script = (
        "import sys, time\n"
        "from tests.engine.core.ring_client import EngineClient\n"
        "from tests.engine.core.test_engine_process import engine_config\n"
        "from pathlib import Path\n"
        "client = EngineClient(engine_config(Path(sys.argv[1])))\n"
        "print(client.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script, str(tiny_dir)],
        stdout=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        assert parent.stdout is not None
        engine_pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while not is_dead(engine_pid):
            assert time.monotonic() < deadline, "the engine outlived its parent"
            time.sleep(0.02)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_an_invalid_request_is_refused_with_an_error_row_not_a_dead_engine(
    client_for: object,
) -> None:
    client: EngineClient = client_for()  # type: ignore[operator]
    client.add(1, [], max_tokens=5)  # an empty prompt
    client.add(2, [5, 6, 7], max_tokens=2)
    client.run_until(lambda: {1, 2} <= client.finish.keys())
    assert client.finish == {1: 4, 2: 2}  # ERROR, LENGTH
    error = next(e for e in client.events if isinstance(e, P.RequestError))
    assert error.rnum == 1 and "empty prompt" in error.message


def test_sigkill_of_worker_rank_1_yields_dead_naming_the_rank_and_signal(
    client_for: object,
) -> None:
    client: EngineClient = client_for(tensor_parallel_size=2)  # type: ignore[operator]
    client.add(1, list(range(10, 40)), max_tokens=10_000)
    client.run_until(lambda: len(client.tokens[1]) >= 3)
    workers = children(client.process.pid)
    assert len(workers) == 2
    rank1 = max(workers, key=_rank_of)
    killed_at = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    with pytest.raises(AssertionError, match="the engine died"):
        client.run_until(lambda: False, timeout=30)
    assert client.dead is not None and client.dead_at is not None
    assert client.dead.where == "worker rank 1"
    assert client.dead.signal == 9
    assert client.dead_at - killed_at < 1.0
    assert client.wait_exit() == 1
    deadline = time.monotonic() + 10
    while not all(is_dead(pid) for pid in workers):
        assert time.monotonic() < deadline, "a worker outlived the engine"
        time.sleep(0.05)
    assert not shm_names()


def _rank_of(pid: int) -> int:
    """A worker's rank, from its process title (`trillm::worker_<rank>`)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        title = f.read().rstrip(b"\0").decode()
    return int(title.removeprefix("trillm::worker_"))
