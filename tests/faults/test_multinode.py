"""Tensor parallelism across nodes: two `trillm serve` processes on 127.0.0.1, node 0 (the
server, the engine and rank 0) and node 1 (`--headless`, rank 1), as two machines would run.

The step broadcast travels over TCP to node 1's agent and into its own broadcast ring;
collectives meet at --master-port. A killed node is named to every stream, and a node that
never comes fails start-up within --distributed-timeout, naming it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

import httpx
import pytest
import trio

from trillm.cli import build_parser, main

from .figures import AT_ONCE, record
from .http_harness import tiny_model_dir
from .proc_harness import (
    Served,
    served,
    shm_names_of,
    strike_during_streams,
    wait_dead,
)

START_TIMEOUT = 240  # three interpreters importing torch on two busy cores
PROMPTS = ["hello", "The capital of France is", "1 2 3 4", "x"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


def free_port_pair() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 now (torch.distributed; the broadcast)."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            if port >= 65535:
                continue
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise AssertionError("no two consecutive free ports")


def no_restart_args() -> tuple[str, ...]:
    """Turn engine restarts off where this build has them: these cases are about one death."""
    _, unknown = build_parser().parse_known_args(["serve", "--no-engine-restart"])
    return () if unknown else ("--no-engine-restart",)


NODE_TOKEN = "test-node-token-0123456789abcdef"  # on the command line: a test's, not a secret


def node_args(master_port: int, timeout: float = 60) -> tuple[str, ...]:
    return (
        "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(master_port), "--distributed-timeout", str(timeout),
        "--node-token", NODE_TOKEN,
    )  # fmt: skip


@contextmanager
def two_nodes(model: Path, *node0_args: str) -> Iterator[tuple[Served, Served]]:
    """Node 1 (headless) and node 0 (healthy), both trees killed on the way out."""
    args = node_args(free_port_pair())
    with ExitStack() as stack:
        node1 = stack.enter_context(
            served(model, *args, "--headless", "--node-rank", "1", healthy=False)
        )
        node0 = stack.enter_context(served(model, *args, *node0_args, start_timeout=START_TIMEOUT))
        node1.tree()
        yield node0, node1


def greedy_texts(server: Served) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    return texts


@pytest.mark.slow
def test_two_nodes_give_the_greedy_tokens_of_one_rank(model: Path) -> None:
    with served(model, start_timeout=START_TIMEOUT) as single:
        expected = greedy_texts(single)
    with two_nodes(model) as (node0, node1):
        assert greedy_texts(node0) == expected
        assert node1.process.poll() is None
        assert len(node1.tree()) == 2  # the agent and its rank
        node0.process.send_signal(signal.SIGTERM)  # a graceful stop ends node 1 too
        assert node0.wait_exit(60) == 0
        assert node1.wait_exit(30) == 0
        wait_dead(node0.seen | node1.seen, 10)
        assert shm_names_of(node0.seen | node1.seen) == []


@pytest.mark.slow
async def test_sigkill_of_the_headless_node_is_named_to_open_and_new_requests(
    model: Path,
) -> None:
    grace = ("--engine-death-grace", "60", *no_restart_args())
    with two_nodes(model, *grace) as (node0, node1):
        victims = node1.tree()

        def kill_node1() -> None:
            for pid in victims:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

        streams, ended, _ = await strike_during_streams(node0, kill_node1, n=8, limit=120)
        assert len(ended) == 8
        record(3, "last of 8 open streams ended after SIGKILL of node 1 (TP=2 on 2 nodes)",
               max(ended) * 1e3, "ms")  # fmt: skip
        assert max(ended) < AT_ONCE
        errors = {s.error for s in streams}
        assert len(errors) == 1, errors
        (error,) = errors
        assert error is not None and error.startswith(
            "the engine died: NodeLostError in worker rank 1 on node 1: the connection to "
            "node 1's agent closed"
        ), error
        response = await trio.to_thread.run_sync(
            lambda: httpx.post(f"{node0.base_url}/v1/completions", json={"prompt": "x"}, timeout=60)
        )
        assert response.status_code == 503
        assert "worker rank 1 on node 1" in response.text
        await trio.to_thread.run_sync(wait_dead, victims, 10)
        assert shm_names_of(node1.seen) == []


@pytest.mark.slow
def test_a_node_that_never_joins_fails_start_up_naming_it(model: Path) -> None:
    port = free_port_pair()
    command = [
        sys.executable, "-m", "trillm.cli", "serve", str(model), "--port", str(port + 2),
        "--dtype", "float32", "--kv-cache-memory-bytes", str(1 << 25),
        *node_args(port, timeout=3), *no_restart_args(),
    ]  # fmt: skip
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    took = time.monotonic() - started
    assert process.returncode == 1
    text = output.decode(errors="replace")
    assert (
        "trillm serve: the engine failed to start: engine raised NodeJoinError: node 1 of 2 did "
        "not join within 3 s (--distributed-timeout): start `trillm serve "
    ) in text, text
    assert "--headless --node-rank 1 --nnodes 2 --tensor-parallel-size 2 --master-addr " in text
    assert took < 60  # start-up and the 3 s, not torch.distributed's own 120 s


TP2_ON_2_NODES = ("--nnodes", "2", "-tp", "2", "--master-port", "3000")
BAD_FLAGS = [
    (("--nnodes", "2", "-tp", "3", "--master-port", "3000"),
     "--tensor-parallel-size 3 is not divisible by --nnodes 2"),
    (("--nnodes", "2", "-tp", "2"), "--master-port is required with --nnodes 2"),
    (("--headless",),
     "--headless runs only a node's worker ranks, so it needs --node-rank >= 1"),
    ((*TP2_ON_2_NODES, "--node-rank", "1"),
     "--node-rank 1 runs only its worker ranks: add --headless"),
    ((*TP2_ON_2_NODES, "--node-rank", "2", "--headless"),
     "--node-rank must be in 0..1 (--nnodes 2), got 2"),
    (("--distributed-timeout", "0"), "--distributed-timeout must be > 0 seconds"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "message"), BAD_FLAGS)
def test_bad_node_flags_are_refused_naming_the_flag(
    model: Path, flags: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", str(model), *flags]) == 1  # refused before anything starts
    assert f"trillm serve: {message}" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1], ids=["rank0-local", "rank1-remote"])
def test_an_exception_in_either_node_names_its_rank_not_the_collective_that_followed(
    model: Path, rank: int
) -> None:
    fault = ("--inject-fault", f"forward:{rank}:3")  # both nodes: each builds its own config
    args = node_args(free_port_pair())
    where = "worker rank 0" if rank == 0 else "worker rank 1 on node 1"
    with ExitStack() as stack:
        stack.enter_context(
            served(model, *args, *fault, "--headless", "--node-rank", "1", healthy=False)
        )
        node0 = stack.enter_context(
            served(model, *args, *fault, *no_restart_args(), start_timeout=START_TIMEOUT)
        )
        body = {"prompt": "x", "max_tokens": 20, "ignore_eos": True}
        response = httpx.post(f"{node0.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code >= 500
        assert f"the engine died: InjectedFault in {where}, raised in " in response.text, (
            response.text
        )
