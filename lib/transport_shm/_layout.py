"""Shared-memory layout of a ring, and the address a peer attaches by.

::

    offset
    0        +----------------------------------------------------------------+
             | magic | version | capacity | num_readers |     (creator, once)  |
    128      +----------------------------------------------------------------+
             | tail | waiting | closed | attached | heartbeat | (writer)       |
    256      +----------------------------------------------------------------+
             | head | waiting | closed | attached | heartbeat | (reader 0)     |
    256+128i | ... reader i's line ...                                        |
    H        +----------------------------------------------------------------+
             | data: `capacity` bytes (a power of two) of 8-byte-aligned      |
             | records [u32 length][u32 kind][payload][pad to 8]; a record    |
             | that does not fit before the end is preceded by a wrap marker  |
             | (kind WRAP) that fills the rest, and starts again at 0.        |
    H+cap    +----------------------------------------------------------------+

Every field is a u64 written by exactly one process: the writer's line only by the writer,
reader i's line only by reader i. Lines are 128 bytes apart (two cache lines) so the adjacent-line
prefetcher cannot make one side's stores invalidate the other's counter. ``tail`` and ``head``
are byte positions that only grow; ``position & (capacity - 1)`` is the offset in the data.
H is the header rounded up to a page, so the data starts page-aligned.

``waiting`` is 0 while its owner is awake. A sleeping reader stores a new epoch (1, 2, ...)
each time it sleeps; the writer rings once per epoch, however many records it publishes
while the reader is waking up. A sleeping writer stores the head position every reader must
pass before it rings (a quarter ring beyond what the record needs: a full ring drains a
while before the writer wakes, instead of one system call per record); each reader rings
once per such value.

``heartbeat`` is a counter its owner bumps (`beat`) to show it is alive, from a thread of its
own if it likes: a watchdog in the peer process declares it dead when the counter stops.
"""

from __future__ import annotations

import os
from typing import Final

import msgspec

MAGIC: Final = int.from_bytes(b"trillmR1", "little")
VERSION: Final = 1
LINE: Final = 128
PAGE: Final = 4096
MAX_READERS: Final = 30
MIN_CAPACITY: Final = 64
RECORD_HEADER: Final = 8  # u32 length, u32 kind
WRAP: Final = 0xFFFF_FFFF  # kind of the wrap marker; not a user kind

# u64 word indices inside the header.
W_MAGIC, W_VERSION, W_CAPACITY, W_NUM_READERS = 0, 1, 2, 3
W_TAIL = LINE // 8
OFF_POSITION, OFF_WAITING, OFF_CLOSED, OFF_ATTACHED, OFF_HEARTBEAT = 0, 1, 2, 3, 4


def reader_word(index: int) -> int:
    """First u64 word of reader `index`'s line."""
    return (2 * LINE + LINE * index) // 8


def header_size(num_readers: int) -> int:
    """Header bytes for `num_readers` readers, rounded up to a page."""
    raw = 2 * LINE + LINE * num_readers
    return (raw + PAGE - 1) // PAGE * PAGE


def record_size(payload: int) -> int:
    """Bytes a record of `payload` bytes occupies in the data area."""
    return (RECORD_HEADER + payload + 7) & ~7


class RingAddress(msgspec.Struct, frozen=True, array_like=True):
    """Everything a peer needs to attach: the segment name and the inherited doorbell fds.

    Pass `fds` to the child with ``pass_fds`` (they keep their numbers), and the address
    itself as bytes (`encode`) on its command line or in its environment.
    """

    name: str
    capacity: int
    num_readers: int
    data_bell_fds: tuple[int, ...]  # one per reader: rung by the writer
    space_bell_fd: int  # rung by readers for the writer

    @property
    def fds(self) -> tuple[int, ...]:
        """The file descriptors the child process must inherit."""
        return (*self.data_bell_fds, self.space_bell_fd)

    def encode(self) -> str:
        """A printable form, for a command line or an environment variable."""
        return msgspec.json.encode(self).decode()

    @classmethod
    def decode(cls, text: str | bytes) -> RingAddress:
        """Parse what `encode` produced."""
        return msgspec.json.decode(text, type=cls)

    def dup(self) -> RingAddress:
        """The same address with duplicated fds, to attach inside the creator's own process.

        Each end owns (and closes) the fds it attached with; a child process that inherited
        them owns its copies already, so only an in-process peer needs this.
        """
        return RingAddress(
            self.name,
            self.capacity,
            self.num_readers,
            tuple(os.dup(fd) for fd in self.data_bell_fds),
            os.dup(self.space_bell_fd),
        )
