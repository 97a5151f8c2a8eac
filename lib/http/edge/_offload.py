"""Work that grows with the request (tokenising, chat templates, decoding large bodies),
run off the trio loop on a bounded pool of threads, so one large request never stalls the
other streams (DESIGN.md §8).

Small work stays on the loop: a hop to a worker thread and back costs 55-70 µs here, about
what tokenising 64 characters or a 2-message chat template takes, while 512 characters take
about 3 hops and 2,048 about 13 (`perf/offload_bench.py`). So work under `INLINE_BELOW`
units runs on the loop (never more than a fraction of a millisecond), the rest on a thread.
A unit is a character of text or a token id; a body counts 1 per 64 bytes.

What a thread frees depends on the GIL: the tokenizers library releases it (a 4 MiB prompt
tokenises beside the loop), a Jinja chat template and msgspec do not, but a thread running
Python gives the GIL back every switch interval (5 ms), so the loop still runs between
those slices. A single C call that holds the GIL (msgspec decoding 4 MiB of token ids,
about 100 ms) is not interrupted by anything; `--max-body-bytes` bounds it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")
INLINE_BELOW = 512  # units of work (characters, token ids, body bytes / 64) run on the loop


def default_threads() -> int:
    """Half the CPUs this process may use, between 1 and 8: the rest stay for the loop and
    the engine (a 4 MiB prompt keeps a tokenizer thread busy for seconds)."""
    return max(1, min(8, len(os.sched_getaffinity(0)) // 2))


class Offload:
    """Runs large work on at most `threads` worker threads at a time, small work inline."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"the tokenizer thread pool needs at least 1 thread, got {threads}")
        self.limiter = trio.CapacityLimiter(threads)

    async def run(self, size: int, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)`: on the loop if `size` is below `INLINE_BELOW`, else on a worker thread.

        Cancelled while a thread runs it, the call returns at once; the thread finishes
        on its own and only then frees its place in the pool (so the pool stays bounded).
        """
        if size < INLINE_BELOW:
            await trio.lowlevel.checkpoint()
            return fn(*args)
        return await trio.to_thread.run_sync(
            fn, *args, limiter=self.limiter, abandon_on_cancel=True
        )
