"""What a ring's writer and readers share: the mapping, the doorbells, attach and close.

Memory ordering (why there is no lock, and where the one fence is)
------------------------------------------------------------------
Every u64 in the header has exactly one writing process (see `_layout`), so no lock exists and
no dead peer can hold one. CPython executes one bytecode after another and every load or store
of shared memory is an opaque call into C (a ``memoryview`` item, ``struct.pack_into``), so the
compiler keeps program order; an aligned 8-byte ``memoryview`` store is one ``mov``, so no
counter is ever torn. On x86-64 (TSO) the hardware keeps store->store, load->load and
load->store order, which is all the data path needs:

- writer: payload stores, then the ``tail`` store. A reader that loads the new ``tail`` then
  loads the payload sees it (store->store on the writer, load->load on the reader).
- reader: payload loads, then the ``head`` store. The writer that sees the new ``head`` reuses
  the space only after the reader finished reading it (load->store on the reader).

TSO may reorder a store with a *later load* from another address, and the eventcount needs
exactly that order on both sides (Dekker):

- sleeper: store ``waiting = 1``; load the peer's counter; sleep if nothing changed.
- waker:   store its counter;     load ``waiting``;        ring the doorbell if set.

Without a full fence between each store and the load after it, both loads may see the old
values and the sleeper sleeps forever. `_RingEnd._fence` is that fence: acquiring and releasing
an uncontended ``threading.Lock`` executes locked read-modify-write instructions (``lock
cmpxchg`` / ``lock xadd`` in glibc's semaphore), which x86 orders as full barriers, for about
40 ns and no system call. Weakly ordered CPUs (aarch64) would also need release/acquire
barriers on the data path; trillm targets x86-64 for now (see docs/design.md).
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from collections.abc import Callable
from typing import Final, NamedTuple, Self, TypeVar

import trio

from . import _layout as L
from ._doorbell import Doorbell
from ._errors import BusyError
from ._layout import RingAddress
from ._segment import Segment

RECORD_HEADER: Final = struct.Struct("<II")  # length, kind
T = TypeVar("T")


class RingStatistics(NamedTuple):
    """A snapshot of one ring end's counters."""

    capacity: int
    used_bytes: int  # published and not yet released by the slowest reader
    records: int  # records this end committed (writer) or released (reader)
    doorbell_rings: int  # eventfd writes this end made to wake its peer
    sleeps: int  # times this end slept on its doorbell


def deadline_after(timeout: float | None) -> float | None:
    """The posix-ipc timeout convention as an absolute `time.monotonic` deadline."""
    return None if timeout is None else time.monotonic() + max(0.0, timeout)


def remaining(deadline: float | None) -> float | None:
    """Seconds left before `deadline` (never negative), or None for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class _RingEnd:
    """One process's end of a ring; `RingWriter` and `RingReader` add the data path."""

    def __init__(
        self,
        segment: Segment,
        address: RingAddress,
        own_word: int,
        own_bell: Doorbell,
        data_bells: list[Doorbell],
        space_bell: Doorbell,
    ) -> None:
        self._segment = segment
        self.address: Final = address
        self.capacity: Final = address.capacity
        self._mask = address.capacity - 1
        buffer = memoryview(segment.buffer)
        header = L.header_size(address.num_readers)
        self._ctl = buffer[:header].cast("Q")
        self._data = buffer[header : header + address.capacity]
        self._own_word = own_word
        self._own_bell = own_bell
        self._data_bells = data_bells
        self._space_bell = space_bell
        self._all_words = [L.W_TAIL] + [L.reader_word(i) for i in range(address.num_readers)]
        lock = threading.Lock()
        self._lock_acquire = lock.acquire
        self._lock_release = lock.release
        self._closed = False
        self._broken: str | None = None
        self._num_records = 0
        self._num_rings = 0
        self._num_sleeps = 0

    @staticmethod
    def _new_segment(capacity: int, num_readers: int) -> Segment:
        if capacity < L.MIN_CAPACITY or capacity & (capacity - 1):
            raise ValueError(
                f"ring capacity must be a power of two >= {L.MIN_CAPACITY}, got {capacity}"
            )
        if not 1 <= num_readers <= L.MAX_READERS:
            raise ValueError(f"num_readers must be in 1..{L.MAX_READERS}, got {num_readers}")
        segment = Segment.create(L.header_size(num_readers) + capacity)
        header = memoryview(segment.buffer)[:64].cast("Q")
        header[L.W_MAGIC] = L.MAGIC
        header[L.W_VERSION] = L.VERSION
        header[L.W_CAPACITY] = capacity
        header[L.W_NUM_READERS] = num_readers
        header.release()
        return segment

    @staticmethod
    def _attach_segment(address: RingAddress) -> Segment:
        size = L.header_size(address.num_readers) + address.capacity
        segment = Segment.attach(address.name, size)
        header = memoryview(segment.buffer)[:64].cast("Q")
        found = (header[L.W_MAGIC], header[L.W_VERSION], header[L.W_CAPACITY])
        num_readers = header[L.W_NUM_READERS]
        header.release()
        if found != (L.MAGIC, L.VERSION, address.capacity) or num_readers != address.num_readers:
            segment.close()
            raise ValueError(f"{address.name} is not a trillm ring of this version and shape")
        return segment

    def _announce_attached(self) -> None:
        """Set our `attached` flag and wake everyone (a creator may be waiting for it)."""
        word = self._own_word + L.OFF_ATTACHED
        if self._ctl[word]:
            self.close()
            raise ValueError(f"this end of ring {self.address.name} is already attached")
        self._ctl[word] = 1
        self._ring_everyone()

    def _ring_everyone(self) -> None:
        for bell in self._data_bells:
            bell.ring()
        self._space_bell.ring()

    def _fence(self) -> None:
        """Full memory barrier (store->load order); see the module docstring."""
        self._lock_acquire()
        self._lock_release()

    def _raise_closed(self) -> None:
        raise trio.ClosedResourceError(
            f"this end of ring {self.address.name} was closed by this process"
        )

    def _raise_broken(self, who: str) -> None:
        if self._broken is not None:
            raise trio.BrokenResourceError(
                f"the peer of ring {self.address.name} was declared dead: {self._broken}"
            )
        raise trio.BrokenResourceError(f"the {who} of ring {self.address.name} closed its end")

    # -- handshake -------------------------------------------------------------------------

    def _peers_attached(self) -> bool:
        return all(self._ctl[w + L.OFF_ATTACHED] for w in self._all_words)

    @property
    def peers_attached(self) -> bool:
        """Whether every other end has attached (`wait_attached` returns at once)."""
        return self._peers_attached()

    def wait_attached(self, timeout: float | None = None) -> None:
        """Block until every other end has attached, then unlink the segment's name.

        Raises:
            BusyError: some end did not attach within `timeout` seconds.
        """
        message = f"the peers of ring {self.address.name} did not attach within {timeout} s"
        self._wait_for(self._attached_or_none, timeout, message, announce=None)
        self._segment.unlink()

    async def wait_attached_async(self) -> None:
        """`wait_attached` for trio; bound it with a cancel scope."""
        await trio.lowlevel.checkpoint()
        await self._wait_for_async(self._attached_or_none, announce=None)
        self._segment.unlink()

    def _attached_or_none(self) -> bool | None:
        self._check_usable()
        return True if all(self._ctl[w + L.OFF_ATTACHED] for w in self._all_words) else None

    def _check_usable(self) -> None:
        if self._closed:
            self._raise_closed()
        if self._broken is not None:
            self._raise_broken("peer")

    # -- the eventcount --------------------------------------------------------------------

    def _wait_for(
        self,
        attempt: Callable[[], T | None],
        timeout: float | None,
        busy: str,
        *,
        announce: Callable[[], int] | None,
    ) -> T:
        """Call `attempt` until it returns non-None, sleeping on our doorbell in between.

        The eventcount: clear the doorbell, announce (store what `announce` returns in our
        `waiting` word), fence, attempt once more, and only then sleep; the peer rings only
        for an announced sleeper. `announce` may raise if no peer could ever wake us; its
        value is non-zero and new for each sleep, so a waker rings once per sleep, not once
        per record it publishes while we are still waking up.
        """
        deadline = deadline_after(timeout)
        try:
            while (result := self._announce_then(attempt, announce)) is None:
                self._num_sleeps += 1
                try:
                    self._own_bell.wait(remaining(deadline))
                except BusyError:
                    raise BusyError(busy) from None
                if (result := attempt()) is not None:
                    break
            return result
        finally:
            self._stop_announcing(announce)

    async def _wait_for_async(
        self, attempt: Callable[[], T | None], *, announce: Callable[[], int] | None
    ) -> T:
        """`_wait_for` for trio: cancellation instead of a timeout."""
        try:
            while (result := self._announce_then(attempt, announce)) is None:
                self._num_sleeps += 1
                try:
                    await self._own_bell.wait_async()
                except trio.ClosedResourceError:
                    self._raise_closed()
                if (result := attempt()) is not None:
                    break
            return result
        finally:
            self._stop_announcing(announce)

    def _announce_then(
        self, attempt: Callable[[], T | None], announce: Callable[[], int] | None
    ) -> T | None:
        self._own_bell.clear()
        if announce is not None:
            self._ctl[self._own_word + L.OFF_WAITING] = announce()
            self._fence()  # store waiting -> load the peer's counter
        return attempt()

    def _stop_announcing(self, announce: Callable[[], int] | None) -> None:
        if announce is not None and not self._closed:
            self._ctl[self._own_word + L.OFF_WAITING] = 0

    # -- liveness --------------------------------------------------------------------------

    def beat(self) -> None:
        """Bump this end's heartbeat counter, for a watchdog in a peer process.

        Safe from a thread of its own: the word has no other writer, and nothing else in
        this end reads it.
        """
        word = self._own_word + L.OFF_HEARTBEAT
        self._ctl[word] = (self._ctl[word] + 1) & 0xFFFF_FFFF_FFFF_FFFF

    def heartbeat_of_writer(self) -> int:
        """The writer's heartbeat counter now (it only changes while the writer is alive)."""
        return int(self._ctl[L.W_TAIL + L.OFF_HEARTBEAT])

    # -- life ------------------------------------------------------------------------------

    def declare_peer_dead(self, reason: str) -> None:
        """Make this end's waiters raise `trio.BrokenResourceError` naming `reason`.

        Called by the process supervisor when the peer exited (DESIGN.md §5): the ring itself
        cannot tell a slow peer from a dead one. Records already published are still read.
        """
        if self._closed or self._broken is not None:
            return
        self._broken = reason
        self._own_bell.ring()

    @property
    def is_closed(self) -> bool:
        """True once this end was closed by this process."""
        return self._closed

    def close(self) -> None:
        """Close this end: peers' waiters see it, ours raise `ClosedResourceError` (idempotent).

        Also unlinks the name if we created it and no peer attached yet.
        """
        if self._closed:
            return
        with contextlib.suppress(ValueError):
            self._ctl[self._own_word + L.OFF_CLOSED] = 1
            self._fence()
        self._closed = True
        self._ring_everyone()
        for bell in {id(b): b for b in [*self._data_bells, self._space_bell]}.values():
            bell.close()
        for view in (self._ctl, self._data):
            with contextlib.suppress(BufferError):
                view.release()
        self._segment.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
