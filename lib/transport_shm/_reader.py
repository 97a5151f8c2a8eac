"""A reading end of a ring: zero-copy `peek` / `release`, sleeping when empty.

Each reader has its own ``head``; in a broadcast ring every reader sees every record. A
reader sleeps through the eventcount: it sets ``waiting``, fences, re-checks ``tail``, and
only then sleeps on its doorbell, so the writer rings (a system call) only for a sleeper.
"""

from __future__ import annotations

from typing import Self

import trio

from . import _layout as L
from ._doorbell import Doorbell
from ._layout import RingAddress
from ._ring import RECORD_HEADER, RingStatistics, _RingEnd
from ._segment import Segment

_unpack_header = RECORD_HEADER.unpack_from
_W_TAIL = L.W_TAIL
_W_CLOSED = L.W_TAIL + L.OFF_CLOSED
_W_WAITING = L.W_TAIL + L.OFF_WAITING
_WRAP = L.WRAP

Record = tuple[int, memoryview]  # (kind, payload), valid until `release`


class RingReader(_RingEnd):
    """Reader `index` of a ring.

    Per record::

        kind, payload = reader.peek()   # memoryview into the ring: read it in place
        ...np.frombuffer(payload, ...)...
        reader.release()                # the space may now be overwritten
    """

    @classmethod
    def create(cls, capacity: int) -> Self:
        """Create a single-reader ring of `capacity` bytes (a power of two), as its reader.

        Give `address` to the writer (fds by ``pass_fds``), then call `wait_attached`.
        """
        segment = cls._new_segment(capacity, 1)
        data_bell, space_bell = Doorbell(), Doorbell()
        address = RingAddress(segment.name, capacity, 1, (data_bell.fd,), space_bell.fd)
        end = cls(segment, address, 0, [data_bell], space_bell)
        end._ctl[L.reader_word(0) + L.OFF_ATTACHED] = 1
        return end

    @classmethod
    def attach(cls, address: RingAddress, index: int = 0) -> Self:
        """Attach as reader `index` of the ring at `address`."""
        if not 0 <= index < address.num_readers:
            raise ValueError(f"reader index {index} not in 0..{address.num_readers - 1}")
        segment = cls._attach_segment(address)
        end = cls(
            segment,
            address,
            index,
            [Doorbell(fd) for fd in address.data_bell_fds],
            Doorbell(address.space_bell_fd),
        )
        end._announce_attached()
        return end

    def __init__(
        self,
        segment: Segment,
        address: RingAddress,
        index: int,
        data_bells: list[Doorbell],
        space_bell: Doorbell,
    ) -> None:
        word = L.reader_word(index)
        super().__init__(segment, address, word, data_bells[index], data_bells, space_bell)
        self.index = index
        self._head_word = word
        self._waiting_word = word + L.OFF_WAITING
        self._head = 0
        self._tail_seen = 0  # a lower bound of the writer's tail
        self._pending: Record | None = None
        self._pending_bytes = 0
        self._sleep_epoch = 0  # our `waiting` word while we sleep: a new value each time
        self._rung_at = 0  # the writer's `waiting` value we last rang for

    def try_peek(self) -> Record | None:
        """The next record, or None if the ring is empty now.

        Peeking again before `release` returns the same record.

        Raises:
            trio.BrokenResourceError: the ring is empty and the writer closed its end or
                was declared dead (everything it published has been read).
            trio.ClosedResourceError: we closed this end.
        """
        if self._pending is not None:
            return self._pending
        if self._closed:
            self._raise_closed()
        head = self._head
        ctl = self._ctl
        while True:
            if head == self._tail_seen:
                tail = ctl[_W_TAIL]
                if head == tail:
                    # `closed` is stored after the last `tail`: load it first, then `tail`.
                    if not ctl[_W_CLOSED] and self._broken is None:
                        return None
                    tail = ctl[_W_TAIL]
                    if head == tail:
                        self._raise_broken("writer")
                self._tail_seen = tail
            pos = head & self._mask
            length, kind = _unpack_header(self._data, pos)
            if kind != _WRAP:
                break
            head += self.capacity - pos
            self._publish_head(head)
        self._pending_bytes = (length + 15) & ~7
        record = self._pending = (kind, self._data[pos + 8 : pos + 8 + length])
        return record

    def peek(self, timeout: float | None = None) -> Record:
        """The next record, blocking while the ring is empty.

        Args:
            timeout: None waits for as long as it takes, 0 fails at once, > 0 is a bound.

        Raises:
            BusyError: nothing arrived within `timeout` seconds.
            trio.BrokenResourceError: see `try_peek`.
        """
        record = self.try_peek()
        if record is not None:
            return record
        busy = f"no record arrived in ring {self.address.name} within {timeout} s"
        return self._wait_for(self.try_peek, timeout, busy, announce=self._announce_sleep)

    async def peek_async(self) -> Record:
        """`peek` for trio: sleeps without a thread; cancellable (checkpoint first, as in
        `RingWriter.reserve_async`)."""
        await trio.lowlevel.checkpoint()
        record = self.try_peek()
        if record is not None:
            return record
        return await self._wait_for_async(self.try_peek, announce=self._announce_sleep)

    def _announce_sleep(self) -> int:
        self._sleep_epoch += 1
        return self._sleep_epoch

    def release(self) -> None:
        """Free the peeked record's space; its payload view must not be used after this."""
        if self._pending is None:
            raise RuntimeError("release() needs a peek() first")
        self._pending = None
        self._publish_head(self._head + self._pending_bytes)
        self._num_records += 1

    def _publish_head(self, head: int) -> None:
        self._head = head
        ctl = self._ctl
        ctl[self._head_word] = head  # our loads of the payload are ordered before (TSO)
        self._lock_acquire()  # full fence: store head -> load the writer's waiting
        self._lock_release()
        wake_at = ctl[_W_WAITING]  # 0, or the head the writer waits for
        if wake_at and head >= wake_at and wake_at != self._rung_at:
            self._rung_at = wake_at  # once per sleep of the writer
            self._space_bell.ring()
            self._num_rings += 1

    def receive(self, timeout: float | None = None) -> tuple[int, bytes]:
        """Copy the next record out and release it (for rare messages)."""
        kind, payload = self.peek(timeout)
        data = bytes(payload)
        self.release()
        return kind, data

    async def receive_async(self) -> tuple[int, bytes]:
        """`receive` for trio."""
        kind, payload = await self.peek_async()
        data = bytes(payload)
        self.release()
        return kind, data

    def statistics(self) -> RingStatistics:
        """Counters of this end (and how many published bytes it has not released)."""
        used = self._ctl[L.W_TAIL] - self._head if not self._closed else 0
        return RingStatistics(
            self.capacity, used, self._num_records, self._num_rings, self._num_sleeps
        )
