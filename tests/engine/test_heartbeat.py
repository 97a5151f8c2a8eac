"""The engine's heartbeat thread and the frontend's watchdog wait, without processes."""

from __future__ import annotations

import time

import trio
import trio.testing

from trillm.engine._heartbeat import Heartbeat, _wait_still, process_state
from trillm.transport_shm import RingReader, RingWriter


def test_the_heartbeat_moves_while_its_block_runs_and_stops_after() -> None:
    with RingWriter.create(4096) as writer, RingReader.attach(writer.address.dup()) as reader:
        writer.wait_attached(timeout=5)
        with Heartbeat(writer, interval=0.01):
            deadline = time.monotonic() + 10
            while reader.heartbeat_of_writer() < 3:
                assert time.monotonic() < deadline, "the heartbeat thread never beat"
                time.sleep(0.01)
        last = reader.heartbeat_of_writer()
        time.sleep(0.05)
        assert reader.heartbeat_of_writer() == last


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
