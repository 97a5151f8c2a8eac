"""Ring semantics within one process: sizes, full, empty, timeouts, close, death."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import trio

from trillm.transport_shm import (
    BusyError,
    RecordTooLargeError,
    RingAddress,
    RingReader,
    RingWriter,
)


def wait_until_asleep(end: RingWriter | RingReader) -> None:
    """Wait until another thread announced that it sleeps on `end` (then counts the sleep)."""
    deadline = time.monotonic() + 10
    while end.statistics().sleeps == 0:
        assert time.monotonic() < deadline, "the other thread never waited"
        time.sleep(0.001)


@pytest.fixture
def ring() -> tuple[RingWriter, RingReader]:
    writer = RingWriter.create(1024)
    reader = RingReader.attach(writer.address.dup())
    writer.wait_attached(timeout=5)
    yield writer, reader
    writer.close()
    reader.close()


def test_numpy_arrays_written_and_read_in_place(ring: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring
    view = writer.reserve(8 * 4 + 4 * 4)
    rnums = np.frombuffer(view, np.uint64, 4, 0)
    tokens = np.frombuffer(view, np.int32, 4, 32)
    rnums[:] = [1, 2, 3, 2**63]
    tokens[:] = [-1, 0, 7, 2**31 - 1]
    del rnums, tokens
    writer.commit(3)
    kind, payload = reader.peek(timeout=0)
    assert kind == 3
    assert np.frombuffer(payload, np.uint64, 4, 0).tolist() == [1, 2, 3, 2**63]
    assert np.frombuffer(payload, np.int32, 4, 32).tolist() == [-1, 0, 7, 2**31 - 1]
    reader.release()


def test_payload_is_8_byte_aligned(ring: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring
    for size in [0, 1, 3, 8, 13, 100]:
        writer.send(0, b"x" * size, timeout=0)
        _, payload = reader.peek(timeout=0)
        address = np.frombuffer(payload, np.uint8).ctypes.data if size else None
        assert address is None or address % 8 == 0
        reader.release()


def test_commit_shorter_than_reserved(ring: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring
    writer.reserve(500)[:3] = b"abc"
    writer.commit(9, 3)
    assert reader.receive(timeout=0) == (9, b"abc")
    assert writer.statistics().used_bytes == 0


def test_exactly_full_then_one_release_makes_room() -> None:
    with RingWriter.create(1024) as writer, RingReader.attach(writer.address.dup()) as reader:
        for i in range(8):  # 8 records of 128 bytes (8 header + 120 payload) fill 1024 exactly
            writer.send(i, bytes([i]) * 120, timeout=0)
        assert writer.statistics().used_bytes == 1024
        assert writer.try_reserve(0) is None
        with pytest.raises(BusyError, match="no room for a 0-byte record"):
            writer.reserve(0, timeout=0)
        assert reader.receive(timeout=0) == (0, bytes([0]) * 120)
        assert writer.try_reserve(120) is not None


def test_largest_record_fills_the_ring_after_a_wrap() -> None:
    with RingWriter.create(256) as writer, RingReader.attach(writer.address.dup()) as reader:
        writer.send(1, b"a" * 40, timeout=0)  # tail at 48: the next big record must wrap
        assert reader.receive(timeout=0) == (1, b"a" * 40)
        big = bytes(range(248))
        with pytest.raises(BusyError):  # wrap marker at 48 published; the reader must pass it
            writer.send(2, big, timeout=0)
        assert reader.try_peek() is None  # skips the marker
        writer.send(2, big, timeout=0)  # fills 0..256
        assert writer.statistics().used_bytes == 256
        assert reader.receive(timeout=0) == (2, big)


def test_a_sleeping_reader_wakes_to_skip_a_wrap_marker() -> None:
    with RingWriter.create(256) as writer, RingReader.attach(writer.address.dup()) as reader:
        writer.send(1, b"a" * 40, timeout=0)
        assert reader.receive(timeout=0) == (1, b"a" * 40)
        got: list[tuple[int, bytes]] = []
        thread = threading.Thread(target=lambda: got.append(reader.receive(timeout=10)))
        thread.start()
        wait_until_asleep(reader)  # on an empty ring
        writer.send(2, b"b" * 248, timeout=10)  # needs the reader to skip the marker
        thread.join(10)
        assert got == [(2, b"b" * 248)]


def test_record_larger_than_the_ring_names_both_sizes(ring: tuple[RingWriter, RingReader]) -> None:
    writer, _ = ring
    with pytest.raises(
        RecordTooLargeError,
        match="a record of 1017 bytes does not fit in a ring of 1024 bytes "
        r"\(the largest record it holds is 1016 bytes\)",
    ):
        writer.reserve(1017)


@pytest.mark.parametrize("capacity", [0, 63, 1000, 3 * 1024])
def test_capacity_must_be_a_power_of_two(capacity: int) -> None:
    with pytest.raises(ValueError, match=f"power of two >= 64, got {capacity}"):
        RingWriter.create(capacity)


def test_empty_ring_timeouts(ring: tuple[RingWriter, RingReader]) -> None:
    _, reader = ring
    assert reader.try_peek() is None
    with pytest.raises(BusyError, match="no record arrived"):
        reader.peek(timeout=0)
    start = time.monotonic()
    with pytest.raises(BusyError, match=r"within 0\.05 s"):
        reader.peek(timeout=0.05)
    assert time.monotonic() - start >= 0.05


def test_peek_twice_returns_the_same_record(ring: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring
    writer.send(1, b"one", timeout=0)
    writer.send(2, b"two", timeout=0)
    first = reader.peek(timeout=0)
    assert reader.peek(timeout=0) is first
    reader.release()
    assert reader.receive(timeout=0) == (2, b"two")
    with pytest.raises(RuntimeError, match="release\\(\\) needs a peek\\(\\) first"):
        reader.release()


def test_blocking_reader_wakes_on_write(ring: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring
    got: list[tuple[int, bytes]] = []
    thread = threading.Thread(target=lambda: got.append(reader.receive(timeout=10)))
    thread.start()
    wait_until_asleep(reader)
    writer.send(5, b"hello", timeout=0)
    thread.join(10)
    assert got == [(5, b"hello")]
    assert writer.statistics().doorbell_rings == 1
    assert reader.statistics().sleeps >= 1


def test_blocking_writer_wakes_when_the_reader_makes_room(
    ring: tuple[RingWriter, RingReader],
) -> None:
    writer, reader = ring
    writer.send(0, b"x" * 1016, timeout=0)
    thread = threading.Thread(target=lambda: writer.send(1, b"y" * 1016, timeout=10))
    thread.start()
    wait_until_asleep(writer)
    assert reader.receive(timeout=0) == (0, b"x" * 1016)
    thread.join(10)
    assert reader.receive(timeout=5) == (1, b"y" * 1016)


def test_writer_close_drains_then_broken(ring: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring
    writer.send(1, b"last words", timeout=0)
    writer.close()
    assert reader.receive(timeout=0) == (1, b"last words")
    with pytest.raises(trio.BrokenResourceError, match=r"the writer of ring \S+ closed its end"):
        reader.peek(timeout=None)


def test_reader_close_breaks_a_waiting_writer(ring: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring
    writer.send(0, b"x" * 1016, timeout=0)
    errors: list[BaseException] = []

    def blocked_send() -> None:
        try:
            writer.send(1, b"y", timeout=10)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=blocked_send)
    thread.start()
    wait_until_asleep(writer)
    reader.close()
    thread.join(10)
    assert len(errors) == 1
    assert isinstance(errors[0], trio.BrokenResourceError)
    assert "the reader of ring" in str(errors[0])


def test_own_close_is_closed_not_broken(ring: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring
    reader.close()
    reader.close()  # idempotent
    with pytest.raises(trio.ClosedResourceError, match="closed by this process"):
        reader.try_peek()
    writer.close()
    with pytest.raises(trio.ClosedResourceError, match="closed by this process"):
        writer.reserve(1)


def test_declared_dead_peer_delivers_published_records_first(
    ring: tuple[RingWriter, RingReader],
) -> None:
    writer, reader = ring
    writer.send(4, b"DEAD record", timeout=0)
    reader.declare_peer_dead("engine exited with signal 9")
    assert reader.receive(timeout=0) == (4, b"DEAD record")
    with pytest.raises(
        trio.BrokenResourceError, match="declared dead: engine exited with signal 9"
    ):
        reader.peek(timeout=None)


def test_the_writers_heartbeat_is_seen_by_the_reader_and_moves_nothing_else(
    ring: tuple[RingWriter, RingReader],
) -> None:
    writer, reader = ring
    assert reader.heartbeat_of_writer() == 0
    beats = threading.Thread(target=lambda: [writer.beat() for _ in range(3)])
    beats.start()
    beats.join()
    assert reader.heartbeat_of_writer() == 3
    reader.beat()  # the reader's own word: not the writer's
    assert reader.heartbeat_of_writer() == 3
    writer.send(1, b"x", timeout=0)
    assert reader.receive(timeout=0) == (1, b"x")


def test_segment_is_0600_and_unlinked_after_handshake(shm_names: object) -> None:
    writer = RingWriter.create(4096)
    name = writer.address.name.lstrip("/")
    try:
        assert name in shm_names()  # type: ignore[operator]
        assert os.stat(f"/dev/shm/{name}").st_mode & 0o777 == 0o600
        assert name.startswith(f"trillm-{os.getpid()}-")
        with RingReader.attach(writer.address.dup()):
            writer.wait_attached(timeout=5)
            assert name not in shm_names()  # type: ignore[operator]
    finally:
        writer.close()
    assert name not in shm_names()  # type: ignore[operator]


def test_close_before_attach_unlinks(shm_names: object) -> None:
    writer = RingWriter.create(4096)
    writer.close()
    assert writer.address.name.lstrip("/") not in shm_names()  # type: ignore[operator]


def test_wait_attached_times_out_with_a_clear_error() -> None:
    with RingWriter.create(4096) as writer, pytest.raises(BusyError, match=r"within 0\.05 s"):
        writer.wait_attached(timeout=0.05)


def test_address_round_trips() -> None:
    address = RingAddress("/trillm-1-ab", 4096, 2, (5, 6), 7)
    assert RingAddress.decode(address.encode()) == address
    assert address.fds == (5, 6, 7)


async def test_trio_close_wakes_a_waiting_task(ring: tuple[RingWriter, RingReader]) -> None:
    _, reader = ring
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:

            async def waiter() -> None:
                with pytest.raises(trio.ClosedResourceError, match="closed by this process"):
                    await reader.peek_async()

            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            reader.close()


async def test_trio_peek_is_cancellable(ring: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring
    with trio.move_on_after(0.05) as scope:
        await reader.peek_async()
    assert scope.cancelled_caught
    writer.send(1, b"after cancel", timeout=0)  # the waiting flag was cleared or harmless
    with trio.fail_after(5):
        assert await reader.receive_async() == (1, b"after cancel")


async def test_trio_writer_waits_for_room(ring: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await writer.send_async(0, b"x" * 1016)
            nursery.start_soon(writer.send_async, 1, b"y" * 1016)
            await trio.testing.wait_all_tasks_blocked()
            assert await reader.receive_async() == (0, b"x" * 1016)
        assert await reader.receive_async() == (1, b"y" * 1016)


def test_a_busy_reader_costs_the_writer_no_doorbell(ring: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring
    for round_ in range(50):
        for i in range(7):
            writer.send(i, bytes([round_]) * 100, timeout=0)
        for i in range(7):
            assert reader.receive(timeout=0) == (i, bytes([round_]) * 100)
    assert writer.statistics().doorbell_rings == 0
    assert reader.statistics().doorbell_rings == 0


def test_doorbells_ring_at_most_once_per_sleep() -> None:
    with RingWriter.create(4096) as writer, RingReader.attach(writer.address.dup()) as reader:
        received: list[int] = []

        def consume() -> None:
            for _ in range(2000):
                kind, _ = reader.peek(timeout=10)
                received.append(kind)
                reader.release()

        thread = threading.Thread(target=consume)
        thread.start()
        for i in range(2000):  # the writer outruns the reader and fills the ring, and back
            writer.send(i % 7, b"z" * (i % 300), timeout=10)
        thread.join(10)
        assert received == [i % 7 for i in range(2000)]
        w, r = writer.statistics(), reader.statistics()
        assert w.doorbell_rings <= r.sleeps
        assert r.doorbell_rings <= w.sleeps
