"""The frontend's watchdog: the engine is declared dead when its heartbeat stops moving.

The engine process beats the output ring's heartbeat word from a thread (`core._heartbeat`,
which says why a thread); a stopped or frozen process stops beating while its pidfd still
says it is alive, so only this catches it.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from ....common.process import process_state
from ....transport_shm import RingReader
from ...protocol._errors import RemoteError


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
