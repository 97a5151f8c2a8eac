"""The frontend's watchdog wait and its /proc reading, without processes."""

from __future__ import annotations

import trio
import trio.testing

from trillm.common.process import process_state
from trillm.engine.client.engines._watchdog import _wait_still


async def test_the_watchdog_waits_for_silence_not_for_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    beats = [0]

    async def beat_until(stop: float) -> None:
        while trio.current_time() < stop:
            beats[0] += 1
            await trio.sleep(0.1)

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(beat_until, start + 5)  # 5 s of beats, far longer than the timeout
        still = await _wait_still(lambda: beats[0], 1.0)
    assert 6.0 <= trio.current_time() - start <= 6.3
    assert 1.0 <= still <= 1.25  # checked every timeout / 4


def test_process_state_reads_proc() -> None:
    assert process_state(1)[0] in "RSDT"
    assert process_state(2**22 + 1) == ""  # above pid_max: no such process
