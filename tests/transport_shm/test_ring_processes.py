"""Rings between real processes: every byte in order, broadcast, trio wake-ups."""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from collections.abc import Iterator

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trillm.transport_shm import RingReader, RingWriter

from .peers import PEER, Peers

CAPACITY = 1024
MAX_PAYLOAD = CAPACITY - 8


@pytest.fixture(scope="module")
def echo_pair() -> Iterator[tuple[RingWriter, RingReader]]:
    """A child process that copies ring `to_child` into ring `from_child`, for the module."""
    peers = Peers()
    to_child = RingWriter.create(CAPACITY)
    from_child = RingReader.create(CAPACITY)
    try:
        peers.spawn(
            "echo",
            to_child.address.encode(),
            from_child.address.encode(),
            pass_fds=to_child.address.fds + from_child.address.fds,
        )
        to_child.wait_attached(timeout=30)
        from_child.wait_attached(timeout=30)
        yield to_child, from_child
    finally:
        to_child.close()
        from_child.close()
        peers.close()


def payload(i: int, size: int) -> bytes:
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


sizes = st.one_of(
    st.integers(0, 64),
    st.integers(0, MAX_PAYLOAD),
    st.sampled_from([MAX_PAYLOAD, MAX_PAYLOAD - 7, CAPACITY // 2 - 8, CAPACITY // 4 - 8]),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(records=st.lists(st.tuples(sizes, st.integers(0, 2**32 - 2)), max_size=80))
def test_every_byte_arrives_in_order_across_processes(
    echo_pair: tuple[RingWriter, RingReader], records: list[tuple[int, int]]
) -> None:
    to_child, from_child = echo_pair
    errors: list[BaseException] = []

    def send_all() -> None:
        try:
            for i, (size, kind) in enumerate(records):
                to_child.send(kind, payload(i, size), timeout=30)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    sender = threading.Thread(target=send_all)
    sender.start()
    try:
        for i, (size, kind) in enumerate(records):
            assert from_child.receive(timeout=30) == (kind, payload(i, size))
        assert from_child.try_peek() is None
    finally:
        sender.join(30)
    assert not errors


def test_broadcast_four_readers_one_slow_see_every_record(peers: Peers) -> None:
    num_records = 3000
    with RingWriter.create(4096, num_readers=4) as writer:
        procs = [
            peers.spawn(
                "broadcast-reader",
                writer.address.encode(),
                str(i),
                "1" if i == 2 else "0",
                pass_fds=writer.address.fds,
            )
            for i in range(4)
        ]
        writer.wait_attached(timeout=30)
        digest = hashlib.sha256()
        for seq in range(num_records):
            size = 8 + (seq * 37) % 500
            data = seq.to_bytes(8, "little") + payload(seq, size - 8)
            digest.update(data)
            writer.send(seq % 1000, data, timeout=30)
        stats = writer.statistics()
    reports = []
    for proc in procs:
        assert proc.stdout is not None
        reports.append(json.loads(proc.stdout.readline()))
        assert proc.wait(timeout=30) == 0
    assert reports == [
        {"index": i, "count": num_records, "digest": digest.hexdigest()} for i in range(4)
    ]
    assert stats.sleeps > 0  # the slow reader made the writer wait for it


async def test_sleeping_trio_reader_wakes_on_every_burst() -> None:
    """Bursts and pauses from another process: no wake-up is lost (else fail_after fires)."""
    num_records = 4000
    reader = RingReader.create(4096)
    with reader:
        async with trio.open_nursery() as nursery:
            proc = await nursery.start(
                lambda **kw: trio.run_process(
                    [sys.executable, PEER, "burst-writer", reader.address.encode(), "4000", "7"],
                    pass_fds=reader.address.fds,
                    capture_stdout=True,
                    **kw,
                )
            )
            with trio.fail_after(60):
                await reader.wait_attached_async()
                for seq in range(num_records):
                    kind, data = await reader.peek_async()
                    assert (kind, int.from_bytes(data[:8], "little")) == (1, seq)
                    reader.release()
                with pytest.raises(
                    trio.BrokenResourceError, match=r"writer of ring \S+ closed its end"
                ):
                    await reader.peek_async()
                await proc.wait()
        assert reader.statistics().sleeps > 10  # it really slept between bursts
