"""Native code run on a thread of its own with a stack as large as its input may need.

Why not `trio.to_thread.run_sync`: trio's worker threads have the default stack (8 MiB, the
`ulimit -s`), and a grammar compiler recursing past it is a SIGSEGV of the whole process.
`threading.stack_size` is process-wide, so it is set only while this module starts its own
thread (under a lock) and put back at once (a thread some other thread starts in that
instant would get the large stack too: harmless). The stack is reserved address space; only
the pages a call touches become memory.

Cancelled (a deadline), the caller leaves at once and the thread is abandoned: it runs to
its end (no thread can be stopped), then gives its `limiter` token back. It is a daemon, so
an abandoned one never holds the process at exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

import outcome
import trio

from ....common.threads import start_thread

T = TypeVar("T")


async def run_sync_on_stack(
    fn: Callable[..., T],
    *args: object,
    stack_bytes: int,
    limiter: trio.CapacityLimiter,
    name: str = "trillm-native",
) -> T:
    """`fn(*args)` on a new daemon thread with a `stack_bytes` stack; its result or error.

    At most `limiter.total_tokens` run at once, abandoned ones included.

    Raises:
        Whatever `fn` raises; trio.Cancelled if cancelled (the thread runs on).
    """
    token = trio.lowlevel.current_trio_token()
    holder = object()
    await limiter.acquire_on_behalf_of(holder)
    done = trio.Event()
    result: list[outcome.Outcome[T]] = []

    def deliver(value: outcome.Outcome[T]) -> None:  # in the trio thread
        result.append(value)
        limiter.release_on_behalf_of(holder)
        done.set()

    def body() -> None:
        value = outcome.capture(fn, *args)
        with contextlib.suppress(trio.RunFinishedError):  # the run ended: nobody to tell
            token.run_sync_soon(deliver, value)

    try:
        start_thread(body, stack_bytes, name)
    except BaseException:
        limiter.release_on_behalf_of(holder)
        raise
    await done.wait()
    return result[0].unwrap()
