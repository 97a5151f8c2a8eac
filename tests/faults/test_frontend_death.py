"""Cases 5 and 6: SIGKILL of the frontend, of every process at once, and before the handshake.

The engine and its workers die with the frontend (a parent-death signal); after the
handshake no shared-memory name exists, so `kill -9` of anyone leaks nothing; a frontend
killed before the handshake leaves its names, and the next start sweeps them.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from .figures import record
from .http_harness import tiny_model_dir
from .proc_harness import (
    SHM,
    Served,
    Stream,
    run_streams,
    served,
    shm_names_of,
    wait_dead,
    wait_for,
)

TP2_START_TIMEOUT = 240
TP = [1, pytest.param(2, marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


async def _strike_while_streaming(server: Served, strike: Callable[[], None]) -> None:
    """Run 8 streams; call `strike()` once every one has a token (the streams then break)."""
    streams: list[Stream] = []
    flowing = trio.Event()
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: run_streams(server, 8, max_tokens=480, flowing=flowing, streams=streams)
            )
            await flowing.wait()
            strike()


@pytest.mark.parametrize("tp", TP, ids=["tp1", "tp2"])
async def test_sigkill_of_the_frontend_takes_engine_and_workers_within_5_s(
    model: Path, tp: int
) -> None:
    args = ("--tensor-parallel-size", str(tp))
    with served(model, *args, start_timeout=TP2_START_TIMEOUT) as server:
        tree = server.tree()
        assert len(tree) == (2 if tp == 1 else 4)  # frontend, engine (, rank 0, rank 1)
        killed: list[float] = []

        def strike() -> None:
            killed.append(time.monotonic())
            server.process.kill()

        await _strike_while_streaming(server, strike)
        server.process.wait()
        await trio.to_thread.run_sync(wait_dead, tree, 5)
        gone = time.monotonic() - killed[0]
        record(5, f"engine and workers gone after the frontend's SIGKILL (TP={tp})", gone, "s")
        assert gone < 5
        assert shm_names_of(tree) == []


async def _kill_9_everything_while_streaming(server: Served) -> None:
    """Case 6's first half: SIGKILL every process of the tree at once, mid-stream; no
    /dev/shm name of any of them is left."""
    tree = server.tree()

    def strike() -> None:
        for pid in tree:
            os.kill(pid, signal.SIGKILL)

    await _strike_while_streaming(server, strike)
    server.process.wait()
    await trio.to_thread.run_sync(wait_dead, tree, 5)
    left = shm_names_of(tree)
    what = f"/dev/shm entries left after kill -9 of all {len(tree)} processes"
    record(6, what, len(left), "names")
    assert left == []


@pytest.mark.slow
async def test_kill_9_of_every_process_at_once_leaves_no_shared_memory_tp2(model: Path) -> None:
    args = ("--tensor-parallel-size", "2")
    with served(model, *args, start_timeout=TP2_START_TIMEOUT) as server:
        assert len(server.tree()) == 4  # frontend, engine, rank 0, rank 1
        await _kill_9_everything_while_streaming(server)


async def test_a_frontend_killed_before_the_handshake_is_swept_by_the_next_start(
    model: Path,
) -> None:
    """Case 6's second half, then its first half at TP=1 on the server of the next start."""
    with served(model, healthy=False) as early:
        pattern = re.compile(rf"^trillm-{early.pid}-[0-9a-f]+$")

        def names() -> list[str]:
            return sorted(n for n in os.listdir(SHM) if pattern.match(n))

        # Both rings are created before the engine starts; the engine needs seconds to import
        # torch and attach, so the frontend is frozen with both names still there.
        await trio.to_thread.run_sync(wait_for, lambda: len(names()) == 2, 60, "both rings")
        os.kill(early.pid, signal.SIGSTOP)
        stale = names()
        tree = early.tree()
        for pid in tree:
            os.kill(pid, signal.SIGKILL)
        early.process.wait()
        await trio.to_thread.run_sync(wait_dead, tree, 5)
    assert len(stale) == 2 and names() == stale  # left behind: nobody unlinked them
    record(6, "names left by a frontend killed before the handshake", len(stale), "names")

    with served(model) as later:  # the next start: its rings' creation sweeps dead pids
        left = [n for n in stale if (SHM / n).exists()]
        record(6, "of them, left after the next start", len(left), "names")
        assert left == []
        assert len(later.tree()) == 2  # frontend, engine
        await _kill_9_everything_while_streaming(later)
