"""Errors of the shared-memory transport, named by cause.

- `trio.ClosedResourceError`: *we* closed this end (or its fd) and then used it.
- `trio.BrokenResourceError`: the *peer* closed its end, or was declared dead by its
  supervisor; the data it had published before that is still delivered first.
- `BusyError`: a bounded wait (``timeout > 0``, or ``timeout=0``) ran out.
- `RecordTooLargeError`: a record can never fit, whatever the reader does.
- `SharedMemorySpaceError`: ``/dev/shm`` cannot hold a new segment.

The closed/broken pair is trio's own classes so a trio program catches them the way it
catches a memory channel's; the others derive from `TransportError`.
"""

from __future__ import annotations


class TransportError(Exception):
    """Base class of the errors that only the transport raises."""


class BusyError(TransportError, TimeoutError):
    """A bounded wait ran out (the posix-ipc name for the same thing)."""


class RecordTooLargeError(TransportError, ValueError):
    """A record is larger than the ring could ever hold."""

    def __init__(self, record_bytes: int, max_record_bytes: int, capacity: int) -> None:
        super().__init__(
            f"a record of {record_bytes} bytes does not fit in a ring of {capacity} bytes "
            f"(the largest record it holds is {max_record_bytes} bytes); "
            f"create the ring with a larger capacity"
        )
        self.record_bytes = record_bytes
        self.max_record_bytes = max_record_bytes
        self.capacity = capacity


class SharedMemorySpaceError(TransportError, OSError):
    """``/dev/shm`` has too little free space for a new segment."""

    def __init__(self, name: str, size: int, free: int, directory: str) -> None:
        super().__init__(
            f"cannot reserve {size} bytes for shared-memory segment {name}: "
            f"{directory} has {free} bytes free; enlarge it (for Docker, --shm-size) "
            f"or ask for smaller rings"
        )
        self.size = size
        self.free = free


class SharedMemoryUnavailableError(TransportError, OSError):
    """No shared-memory segment can be created: ``/dev/shm`` is missing or not writable."""

    def __init__(self, name: str, directory: str, cause: BaseException) -> None:
        super().__init__(
            f"cannot create shared-memory segment {name}: {cause}; trillm's rings live in "
            f"{directory}, which must be a writable tmpfs: mount one (as root: mount -t tmpfs "
            f"-o size=1g tmpfs {directory}; for Docker, --shm-size or --ipc=host)"
        )
        self.directory = directory
