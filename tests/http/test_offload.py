"""`Offload`: small work on the loop, large work on at most N threads, cancellation prompt."""

from __future__ import annotations

import threading

import pytest
import trio

from trillm.http.edge._offload import INLINE_BELOW, Offload, default_threads


async def test_small_work_runs_on_the_loop_large_work_on_a_thread() -> None:
    offload = Offload(2)
    loop = threading.get_ident()
    assert await offload.run(INLINE_BELOW - 1, threading.get_ident) == loop
    assert await offload.run(INLINE_BELOW, threading.get_ident) != loop


async def test_at_most_threads_run_at_once() -> None:
    offload = Offload(2)
    running, most = [0], [0]
    lock = threading.Lock()
    release = threading.Event()

    def work() -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        release.wait(10)
        with lock:
            running[0] -= 1

    async with trio.open_nursery() as nursery:
        for _ in range(6):
            nursery.start_soon(offload.run, INLINE_BELOW, work)
        while running[0] < 2:  # both threads inside `work` (a thread may start late)
            await trio.sleep(0.01)
        assert offload.limiter.statistics().tasks_waiting == 4
        release.set()
    assert most[0] == 2


async def test_a_cancelled_call_returns_at_once_and_keeps_its_place_until_done() -> None:
    offload = Offload(1)
    release = threading.Event()
    with trio.move_on_after(0.1) as scope:
        await offload.run(INLINE_BELOW, release.wait, 10)
    assert scope.cancelled_caught
    assert offload.limiter.borrowed_tokens == 1  # the thread still runs: the pool is bounded
    release.set()
    with trio.fail_after(10):
        while offload.limiter.borrowed_tokens:
            await trio.sleep(0.01)


def test_the_pool_size() -> None:
    assert 1 <= default_threads() <= 8
    with pytest.raises(ValueError, match=r"^the tokenizer thread pool needs at least 1 thread"):
        Offload(0)
