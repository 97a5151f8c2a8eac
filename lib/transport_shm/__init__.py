"""Shared-memory transport: lock-free rings of variable-length records between processes.

Knows nothing of the engine: it moves bytes and arrays (DESIGN.md §5).

- `RingWriter` / `RingReader`: one writer, one or more readers (a broadcast ring), zero-copy
  `reserve`/`commit` and `peek`/`release`, eventcount doorbells that trio awaits without a
  thread and plain threads block on with a timeout.
- `Segment`: a named shared-memory object that is unlinked once attached and swept when its
  creator died early.
"""

from ._errors import BusyError as BusyError
from ._errors import RecordTooLargeError as RecordTooLargeError
from ._errors import SharedMemorySpaceError as SharedMemorySpaceError
from ._errors import SharedMemoryUnavailableError as SharedMemoryUnavailableError
from ._errors import TransportError as TransportError
from ._heartbeat import Heartbeat as Heartbeat
from ._layout import RingAddress as RingAddress
from ._reader import Record as Record
from ._reader import RingReader as RingReader
from ._ring import RingStatistics as RingStatistics
from ._segment import Segment as Segment
from ._segment import sweep_stale_segments as sweep_stale_segments
from ._writer import RingWriter as RingWriter
