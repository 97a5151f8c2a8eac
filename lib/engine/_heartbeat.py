"""Liveness of the engine process: a heartbeat it writes, a watchdog the frontend runs.

The engine bumps the heartbeat word of its output ring from a thread of its own, every
`HEARTBEAT_INTERVAL` seconds, from before the model loads until the process ends. The
frontend's watchdog declares the engine dead when the word has not moved for its timeout.

Why a thread and not the busy loop: a healthy forward pass (a long prefill on CPU, a first
CUDA kernel compile) or a model load may take longer than any timeout worth having, and the
loop does not come up for air during it; a beating loop would make a slow step a death.
What stops the thread stops the whole process: SIGSTOP (a debugger, a cgroup freezer, a
terminal's Ctrl-Z), a kernel that no longer schedules it, or a native call that holds the
GIL for the whole timeout. What it does not catch is a loop stuck with the GIL released
while the process runs (a collective waiting on a live but hung peer): the pidfd supervisors
and the per-rank result rings catch the dead-peer cases, a hung live peer remains undetected
(docs/design.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Final, Self

import trio

from ..transport_shm import RingReader, RingWriter
from ._errors import RemoteError

HEARTBEAT_INTERVAL: Final = 0.1  # seconds between beats
MIN_WATCHDOG_TIMEOUT: Final = 5 * HEARTBEAT_INTERVAL  # a shorter one would fire on jitter


class Heartbeat:
    """Beats `ring` from a daemon thread while the `with` block runs (engine side).

    Leave the block before the ring is closed: a beat after `close` would touch unmapped
    memory (the thread stops at the first error instead).
    """

    def __init__(self, ring: RingWriter, interval: float = HEARTBEAT_INTERVAL) -> None:
        self._ring = ring
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trillm-heartbeat", daemon=True)

    def __enter__(self) -> Self:
        self._ring.beat()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._ring.beat()
            except (ValueError, TypeError):  # the ring was closed under us: nothing to show
                return


async def wait_heartbeat_stopped(ring: RingReader, timeout: float) -> float:
    """Return once `ring`'s writer has not beaten for `timeout` seconds (frontend side).

    Returns:
        How many seconds the heartbeat had been still when noticed (at least `timeout`,
        at most a quarter more).
    """
    return await _wait_still(ring.heartbeat_of_writer, timeout)


async def _wait_still(read: Callable[[], int], timeout: float) -> float:
    # A value compare, not a time compare: if this task itself was held up (a busy event
    # loop, a stopped frontend), a writer that went on beating has moved the value.
    period = min(timeout / 4, 0.5)
    last, moved_at = read(), trio.current_time()
    while True:
        await trio.sleep(period)
        beat, now = read(), trio.current_time()
        if beat != last:
            last, moved_at = beat, now
        elif now - moved_at >= timeout:
            return now - moved_at


def not_responding_error(pid: int, still: float, timeout: float) -> RemoteError:
    """The root cause the watchdog reports for the engine process `pid` (then kills it)."""
    state = process_state(pid)
    return RemoteError(
        "engine",
        "EngineNotRespondingError",
        f"no heartbeat from the engine process (pid {pid}"
        + (f", state {state}" if state else "")
        + f") for {still:.1f} s, more than the watchdog timeout of {timeout:g} s "
        "(--engine-watchdog-timeout); it was killed with SIGKILL",
    )


def process_state(pid: int) -> str:
    """The process's scheduler state from /proc ("T (stopped)", "R (running)", ...), or ""."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
