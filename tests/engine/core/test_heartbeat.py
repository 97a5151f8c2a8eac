"""The engine's heartbeat thread, without processes."""

from __future__ import annotations

import time

from trillm.engine.core._heartbeat import Heartbeat
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
