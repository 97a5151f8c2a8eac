"""Cases 2 and 3: a forward pass that raises (TP=1 and TP=2), and SIGKILL of worker rank 1.

The error every client sees names the exception, the function it was raised in and the rank
(or the signal and the rank), and nothing of the engine's tree outlives it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import trio

from .figures import AT_ONCE, record
from .http_harness import open_sse, tiny_model_dir
from .proc_harness import (
    completion,
    health,
    served,
    shm_names_of,
    strike_during_streams,
    wait_dead,
)

TP2_START_TIMEOUT = 240  # two ranks importing torch on two busy cores


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


@pytest.mark.parametrize(
    ("tp", "rank"), [(1, 0), pytest.param(2, 1, marks=pytest.mark.slow)], ids=["tp1", "tp2"]
)
async def test_an_exception_in_the_forward_pass_names_exception_function_and_rank(
    model: Path, tp: int, rank: int
) -> None:
    fault = f"forward:{rank}:3"  # the fourth forward of that rank raises InjectedFault
    args = ("--tensor-parallel-size", str(tp), "--inject-fault", fault, "--engine-death-grace", "0")
    with served(model, *args, start_timeout=TP2_START_TIMEOUT) as server:
        body = json.dumps(
            {"prompt": "x", "max_tokens": 50, "stream": True, "ignore_eos": True}
        ).encode()
        sent = time.monotonic()
        reader = await open_sse(server.port, "/v1/completions", body)
        async with reader.stream:
            assert await reader.read_status() == 200
            with trio.fail_after(60):
                events = [await reader.next_event()]
                while events[-1] not in (None, b"[DONE]"):
                    events.append(await reader.next_event())
        error_at = time.monotonic()
        assert events[-1] == b"[DONE]"
        message = json.loads(events[-2] or b"")["error"]["message"]
        assert message.startswith(
            f"the engine died: InjectedFault in worker rank {rank}, raised in "
            f"LlamaForCausalLM.forward (llama.py:"
        )
        assert message.endswith("injected fault in LlamaForCausalLM.forward (test hook)")
        record(
            2,
            f"request to its error event, the 4th forward raising (TP={tp}, rank {rank})",
            (error_at - sent) * 1e3,
            "ms",
        )
        assert await trio.to_thread.run_sync(server.wait_exit, 30) == 1
        assert f"trillm serve: the engine died: InjectedFault in worker rank {rank}" in (
            server.output()
        )
        wait_dead(server.seen, 10)
        assert shm_names_of(server.seen) == []


@pytest.mark.slow
async def test_sigkill_of_worker_rank_1_mid_decode_names_the_rank_and_leaves_no_orphan(
    model: Path,
) -> None:
    args = ("--tensor-parallel-size", "2", "--keep-alive-on-engine-death")
    with served(model, *args, start_timeout=TP2_START_TIMEOUT) as server:
        engine = server.engine_pid()
        rank0, rank1 = server.worker_pids()
        streams, ended, killed = await strike_during_streams(
            server, lambda: os.kill(rank1, signal.SIGKILL), limit=120
        )
        assert len(ended) == 64
        record(3, "last of 64 open streams ended after SIGKILL of rank 1", max(ended) * 1e3, "ms")
        assert max(ended) < AT_ONCE
        assert {s.error for s in streams} == {
            "the engine died: worker rank 1 process killed by signal 9 (SIGKILL)"
        }
        assert await trio.to_thread.run_sync(health, server) == 503
        assert (await trio.to_thread.run_sync(completion, server)).status_code == 503

        await trio.to_thread.run_sync(wait_dead, [engine, rank0, rank1], 10)
        gone = time.monotonic() - killed
        record(3, "engine and rank 0 gone after SIGKILL of rank 1", gone * 1e3, "ms")
        await trio.sleep(max(0.0, killed + 10 - time.monotonic()))  # "10 s later"
        assert server.tree() == [server.pid]  # no orphan: the frontend has no descendant left
        assert all(not os.path.exists(f"/proc/{pid}") for pid in (engine, rank0, rank1)), (
            "a process of the engine's tree is still there (a zombie nobody reaps)"
        )
        assert shm_names_of(server.seen) == []
        assert await trio.to_thread.run_sync(health, server) == 503  # still serving its 503s
        assert server.process.poll() is None
