"""The writing end of a ring: zero-copy `reserve` / `commit`, waiting when full.

With one reader this is the SPSC ring; with N readers it is the broadcast ring, and the
writer waits for the slowest one. Space is never dropped or overwritten: a full ring makes
the writer wait (async in trio, blocking with a timeout elsewhere).
"""

from __future__ import annotations

from typing import Self

import trio

from . import _layout as L
from ._doorbell import Doorbell
from ._errors import RecordTooLargeError
from ._layout import RingAddress
from ._ring import RECORD_HEADER, RingStatistics, _RingEnd
from ._segment import Segment

_pack_header = RECORD_HEADER.pack_into
_W_TAIL = L.W_TAIL
_WRAP = L.WRAP


class RingWriter(_RingEnd):
    """The one writer of a ring.

    Create it (`create`) or attach to a ring a reader created (`attach`). Then, per record::

        view = writer.reserve(nbytes)   # memoryview of the payload, 8-byte aligned
        ...fill view in place (np.frombuffer(view, ...)[:] = ...)...
        writer.commit(kind)             # publishes it; `commit(kind, n)` keeps the first n
    """

    @classmethod
    def create(cls, capacity: int, *, num_readers: int = 1) -> Self:
        """Create a ring of `capacity` data bytes (a power of two) for `num_readers` readers.

        Give `address` to each reader (fds by ``pass_fds``), then call `wait_attached`.
        """
        segment = cls._new_segment(capacity, num_readers)
        data_bells = [Doorbell() for _ in range(num_readers)]
        space_bell = Doorbell()
        address = RingAddress(
            segment.name, capacity, num_readers, tuple(b.fd for b in data_bells), space_bell.fd
        )
        end = cls(segment, address, data_bells, space_bell)
        end._ctl[L.W_TAIL + L.OFF_ATTACHED] = 1
        return end

    @classmethod
    def attach(cls, address: RingAddress) -> Self:
        """Attach as the writer of the ring at `address` (created by a reader)."""
        segment = cls._attach_segment(address)
        end = cls(
            segment,
            address,
            [Doorbell(fd) for fd in address.data_bell_fds],
            Doorbell(address.space_bell_fd),
        )
        end._announce_attached()
        return end

    def __init__(
        self,
        segment: Segment,
        address: RingAddress,
        data_bells: list[Doorbell],
        space_bell: Doorbell,
    ) -> None:
        super().__init__(segment, address, L.W_TAIL, space_bell, data_bells, space_bell)
        self.max_record_bytes = address.capacity - L.RECORD_HEADER
        self._head_words = [L.reader_word(i) for i in range(address.num_readers)]
        self._waiting_words = [w + L.OFF_WAITING for w in self._head_words]
        self._single_reader = address.num_readers == 1
        self._reader0_waiting = self._waiting_words[0]
        self._rung_epochs = [0] * address.num_readers  # the sleep each reader was rung for
        self._tail = 0
        self._min_head = 0  # a lower bound of every reader's head, refreshed when short
        self._reserved_at = -1  # data offset of the reserved record, -1 if none
        self._reserved_bytes = 0
        self._short_of = 0  # the end position the last failed `try_reserve` needed

    def _has_space(self, end: int) -> bool:
        """Whether the byte position `end` can be written (the slowest reader passed it)."""
        ctl = self._ctl
        self._min_head = min(ctl[w] for w in self._head_words)
        if end - self._min_head <= self.capacity:
            return True
        self._short_of = end
        return False

    def _wake_me_at(self) -> int:
        """The head every reader must reach before it rings us, stored in our `waiting`.

        A quarter of the ring beyond what the record needs (hysteresis): a reader that
        trails a faster writer rings once per quarter ring, not once per record. Capped at
        `tail`, which readers can always reach.
        """
        return min(self._short_of - self.capacity + self.capacity // 4, self._tail)

    def try_reserve(self, nbytes: int) -> memoryview | None:
        """Reserve a payload of `nbytes` if there is room now, else return None.

        Raises:
            RecordTooLargeError: `nbytes` exceeds `max_record_bytes`.
            trio.ClosedResourceError: we closed this end.
            trio.BrokenResourceError: the peer was declared dead.
        """
        if self._closed or self._broken is not None:
            self._check_usable()
        total = (nbytes + 15) & ~7
        capacity = self.capacity
        if total > capacity or nbytes < 0:
            if nbytes < 0:
                raise ValueError(f"nbytes must be >= 0, got {nbytes}")
            raise RecordTooLargeError(nbytes, self.max_record_bytes, capacity)
        tail = self._tail
        pos = tail & self._mask
        room = capacity - pos
        if total > room:  # wrap: a marker fills the rest, the record starts at 0
            if tail + room - self._min_head > capacity and not self._has_space(tail + room):
                return None
            _pack_header(self._data, pos, 0, L.WRAP)
            tail += room
            self._publish_tail(tail)  # a sleeping reader must wake to skip it, or we wait forever
            pos = 0
        if tail + total - self._min_head > capacity and not self._has_space(tail + total):
            return None
        self._reserved_at = pos
        self._reserved_bytes = nbytes
        return self._data[pos + 8 : pos + 8 + nbytes]

    def reserve(self, nbytes: int, timeout: float | None = None) -> memoryview:
        """Reserve a payload of `nbytes`, blocking while the ring is full.

        Args:
            timeout: None waits for as long as it takes, 0 fails at once, > 0 is a bound.

        Raises:
            BusyError: still no room after `timeout` seconds.
            trio.BrokenResourceError: a reader closed or was declared dead.
        """
        view = self.try_reserve(nbytes)
        if view is not None:
            return view
        busy = (
            f"no room for a {nbytes}-byte record in ring {self.address.name} "
            f"within {timeout} s: a reader is not keeping up"
        )
        return self._wait_for(
            lambda: self.try_reserve(nbytes), timeout, busy, announce=self._announce_sleep
        )

    async def reserve_async(self, nbytes: int) -> memoryview:
        """`reserve` for trio: waits without a thread; cancellable.

        The checkpoint comes before the reservation, never between it and the return, so a
        task that fills and commits the view before its next `await` cannot lose it to
        another task. Tasks sharing one writer must still serialise their waits (a doorbell
        has one waiter): hold a `trio.Lock` around reserve + commit.
        """
        await trio.lowlevel.checkpoint()
        view = self.try_reserve(nbytes)
        if view is not None:
            return view
        return await self._wait_for_async(
            lambda: self.try_reserve(nbytes), announce=self._announce_sleep
        )

    def _announce_sleep(self) -> int:
        self._check_readers()
        return self._wake_me_at()

    def _check_readers(self) -> None:
        self._check_usable()
        for word in self._head_words:
            if self._ctl[word + L.OFF_CLOSED]:
                self._raise_broken("reader")

    def commit(self, kind: int, nbytes: int | None = None) -> None:
        """Publish the reserved record as `kind`, keeping its first `nbytes` (default: all).

        Wakes the readers that sleep; a reader that is busy costs nothing (no system call).
        """
        pos = self._reserved_at
        if pos < 0 or self._closed:
            if self._closed:
                self._raise_closed()
            raise RuntimeError("commit() needs a reserve() first")
        if nbytes is None:
            nbytes = self._reserved_bytes
        elif not 0 <= nbytes <= self._reserved_bytes:
            raise ValueError(f"commit of {nbytes} bytes, but {self._reserved_bytes} reserved")
        if not 0 <= kind < _WRAP:
            raise ValueError(f"record kind must be in 0..{_WRAP - 1}, got {kind}")
        _pack_header(self._data, pos, nbytes, kind)
        self._reserved_at = -1
        self._num_records += 1
        self._publish_tail(self._tail + ((nbytes + 15) & ~7))

    def _publish_tail(self, tail: int) -> None:
        self._tail = tail
        ctl = self._ctl
        ctl[_W_TAIL] = tail  # the payload stores are ordered before it (TSO)
        self._lock_acquire()  # full fence: store tail -> load waiting (eventcount)
        self._lock_release()
        if self._single_reader:
            epoch = ctl[self._reader0_waiting]
            if epoch and epoch != self._rung_epochs[0]:  # once per sleep, not per record
                self._ring_reader(0, epoch)
            return
        for i, word in enumerate(self._waiting_words):
            epoch = ctl[word]
            if epoch and epoch != self._rung_epochs[i]:
                self._ring_reader(i, epoch)

    def _ring_reader(self, index: int, epoch: int) -> None:
        self._rung_epochs[index] = epoch
        self._data_bells[index].ring()
        self._num_rings += 1

    def send(self, kind: int, data: bytes | memoryview, timeout: float | None = None) -> None:
        """Copy `data` into one record (for rare messages; the hot path uses `reserve`)."""
        self.reserve(len(data), timeout)[:] = data
        self.commit(kind)

    async def send_async(self, kind: int, data: bytes | memoryview) -> None:
        """`send` for trio."""
        view = await self.reserve_async(len(data))
        view[:] = data
        self.commit(kind)

    def statistics(self) -> RingStatistics:
        """Counters of this end (and how full the ring is)."""
        used = self._tail - min(self._ctl[w] for w in self._head_words) if not self._closed else 0
        return RingStatistics(
            self.capacity, used, self._num_records, self._num_rings, self._num_sleeps
        )
