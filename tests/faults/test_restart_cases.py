"""Engine restarts under `trillm serve`: a worker rank's death at TP=2 resumed, deaths past
`--max-engine-restarts` final, and five restarts leaving the frontend as it was.

The restart itself is `tests/faults/test_engine_restart.py`; these are the cases around it.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import suppress
from pathlib import Path

import httpx
import pytest
import trio

from .figures import record
from .http_harness import tiny_model_dir
from .proc_harness import (
    Served,
    completion,
    completion_texts,
    served,
    shm_names_of,
    stream_through_strike,
    wait_restarted,
)

TP2_START_TIMEOUT = 240  # two ranks importing torch on two busy cores


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strike", ["SIGKILL", "SIGSTOP"])
async def test_sigkill_or_sigstop_of_worker_rank_1_at_tp2_resumes_8_streams_with_the_same_text(
    model: Path, strike: str
) -> None:
    """A stopped rank is alive to its pidfd: its heartbeat (beaten by a thread of its own)
    stops, the executor declares it not responding after the watchdog timeout and kills it."""
    prompts = [f"The story number {i} begins" for i in range(8)]
    body = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}
    args = ("--tensor-parallel-size", "2", "--max-engine-restarts", "2")
    args += ("--engine-watchdog-timeout", "2")
    with served(model, *args, start_timeout=TP2_START_TIMEOUT) as server:
        url = f"{server.base_url}/v1/completions"
        async with httpx.AsyncClient(timeout=120) as client:
            expected = await completion_texts(client, url, prompts, body)  # never interrupted
            rank1 = server.worker_pids()[1]
            with trio.fail_after(300):
                got = await stream_through_strike(
                    client, url, prompts, body, lambda: os.kill(rank1, getattr(signal, strike))
                )
        assert not got.errors
        assert got.texts == expected
        assert got.first_after_strike is not None, (
            f"no token after the kill: every stream had ended before it\n{server.output()}"
        )
        record(20, f"{strike} of worker rank 1 at TP=2, 8 open streams: signal to the first "
               "resumed token", got.first_after_strike, "s")  # fmt: skip
        output = server.output()
        if strike == "SIGKILL":
            assert "worker rank 1 process killed by signal 9" in output
        else:
            assert "WorkerNotRespondingError in worker rank 1" in output
            assert "state T (stopped)" in output and "--engine-watchdog-timeout" in output
        assert "8 open requests resume on it" in output


@pytest.mark.timeout(400)
@pytest.mark.slow
async def test_a_third_death_within_the_window_past_2_restarts_exits_naming_the_cause(
    model: Path,
) -> None:
    args = ("--max-engine-restarts", "2", "--engine-death-grace", "1")
    with served(model, *args) as server:
        started = time.monotonic()
        engine = server.engine_pid()
        for _ in range(2):
            os.kill(engine, signal.SIGKILL)
            engine = await wait_restarted(server, engine)
        os.kill(engine, signal.SIGKILL)
        killed = time.monotonic()
        status = await trio.to_thread.run_sync(server.wait_exit, 60)
        record(22, "three SIGKILLs, --max-engine-restarts 2: third kill to exit",
               time.monotonic() - killed, "s")  # fmt: skip
        record(22, "three SIGKILLs, --max-engine-restarts 2: start to exit",
               time.monotonic() - started, "s")  # fmt: skip
        assert status == 1
        output = server.output()
        assert output.count("starting it again") == 2
        assert (
            "trillm: the engine died: engine process killed by signal 9 (SIGKILL); not "
            "restarted: 2 restarts within 300 s already (--max-engine-restarts, "
            "--engine-restart-window)"
        ) in output


def http_connection_inodes(port: int) -> set[str]:
    """Socket inodes of the TCP connections accepted on `port` (not its listening socket)."""
    inodes: set[str] = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            listening = fields[3] == "0A"
            if int(fields[1].rsplit(":", 1)[1], 16) == port and not listening:
                inodes.add(fields[9])
    return inodes


def fds(server: Served) -> int:
    """The frontend's open descriptors but its HTTP connections: those are the clients' (this
    test's polls, closed by the client, linger until hypercorn reads the close), not the
    engine's, and come and go with the load."""
    clients = {f"socket:[{inode}]" for inode in http_connection_inodes(server.port)}
    count = 0
    for fd in os.listdir(f"/proc/{server.pid}/fd"):
        with suppress(FileNotFoundError):  # closed while listed
            count += os.readlink(f"/proc/{server.pid}/fd/{fd}") not in clients
    return count


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def trillm_shm(server: Served) -> list[str]:
    """The /dev/shm `trillm-*` names of this server's tree (another suite's are not ours)."""
    server.tree()
    return [n for n in shm_names_of(server.seen) if n.startswith("trillm-")]


@pytest.mark.timeout(600)
@pytest.mark.slow
async def test_five_restarts_leave_fds_threads_and_shared_memory_at_the_baseline(
    model: Path,
) -> None:
    with served(model, "--max-engine-restarts", "5") as server:
        reply = await trio.to_thread.run_sync(lambda: completion(server, max_tokens=4))
        assert reply.status_code == 200
        base = (fds(server), threads(server.pid), trillm_shm(server))
        base_rss = rss_mib(server.pid)
        engine = server.engine_pid()
        for _ in range(5):
            os.kill(engine, signal.SIGKILL)
            engine = await wait_restarted(server, engine)
            reply = await trio.to_thread.run_sync(lambda: completion(server, max_tokens=4))
            assert reply.status_code == 200
        after = (fds(server), threads(server.pid), trillm_shm(server))
        growth = rss_mib(server.pid) - base_rss
        record(21, f"five restarts: frontend fds {base[0]} -> {after[0]}", after[0], "fds")
        record(21, f"five restarts: frontend threads {base[1]} -> {after[1]}", after[1], "threads")
        record(21, "five restarts: frontend RSS growth", growth, "MiB")
        assert after[0] == base[0]
        # trio's idle worker threads exit after 10 s, so the count may fall; it must not grow.
        assert after[1] <= base[1]
        assert after[2] == base[2] == []
        assert "restart 5, at most 5" in server.output()
