"""Named POSIX shared-memory segments that cannot leak.

A segment is created under a unique name ``/trillm-<pid>-<16 hex>`` with ``O_CREX`` and mode
0600, its whole size reserved with ``posix_fallocate`` (a full ``/dev/shm`` fails here, with
the size and the free space in the message, instead of a SIGBUS on first touch later) and its
pages faulted in with ``MAP_POPULATE``. The name exists only until the peer has attached: the
creator then unlinks it (and again when it closes), after which the mapping lives on in each
process and the kernel frees it with the last one, whoever is ``kill -9``-ed. A creator killed
before the handshake leaves the name behind; `sweep_stale_segments` (run by every `create`)
removes names whose pid is dead, if they are ours: a ``trillm-*`` file of another user (or
one we may not unlink) is left alone, never a reason to fail.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import stat
from typing import Final

import posix_ipc

from ._errors import SharedMemorySpaceError, SharedMemoryUnavailableError

SHM_DIR: Final = "/dev/shm"
PREFIX: Final = "trillm"
_NAME_RE: Final = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+$")


def _pid_is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but someone else's
        return True
    return True


def sweep_stale_segments(directory: str = SHM_DIR) -> list[str]:
    """Unlink ``trillm-<pid>-*`` segments of ours whose creating pid no longer exists.

    Only regular files owned by our effective uid are candidates: anyone can create a
    ``trillm-*`` name in a shared ``/dev/shm``, and a sweep run at every start must neither
    delete other users' files (root could) nor fail on one it may not unlink. Every error
    is a skip: a sweep is housekeeping, never a reason not to start.

    Returns:
        The names removed (without the leading slash).
    """
    removed: list[str] = []
    try:
        entries = os.listdir(directory)
    except OSError:  # missing, or not ours to read
        return removed
    uid = os.geteuid()
    for entry in entries:
        match = _NAME_RE.match(entry)
        if match is None or _pid_is_alive(int(match.group(1))):
            continue
        path = os.path.join(directory, entry)
        try:
            info = os.lstat(path)
            if info.st_uid != uid or not stat.S_ISREG(info.st_mode):
                continue
            os.unlink(path)
        except OSError:  # gone already, or we may not unlink it (the directory is not ours)
            continue
        removed.append(entry)
    return removed


def _map(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)


class Segment:
    """A shared-memory object mapped into this process.

    Use `Segment.create` in the process that owns the name and `Segment.attach` in its peer.
    `buffer` is the mapping; views of it stay valid until the last one is released, even
    after `close`.
    """

    def __init__(self, name: str, buffer: mmap.mmap, *, is_creator: bool) -> None:
        self.name: Final = name
        self.buffer: Final = buffer
        self.size: Final = len(buffer)
        self.is_creator: Final = is_creator
        self._unlinked = not is_creator

    @classmethod
    def create(cls, size: int) -> Segment:
        """Create, reserve and map a new segment of `size` bytes.

        Raises:
            SharedMemorySpaceError: ``/dev/shm`` has fewer than `size` bytes free.
            SharedMemoryUnavailableError: ``/dev/shm`` is missing or not writable.
        """
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        sweep_stale_segments()
        name = f"/{PREFIX}-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=0)
        except (posix_ipc.Error, OSError) as exc:  # ENOENT, EACCES, EROFS: no /dev/shm to use
            raise SharedMemoryUnavailableError(name, SHM_DIR, exc) from exc
        try:
            os.fchmod(shm.fd, 0o600)  # whatever the umask
            try:
                os.posix_fallocate(shm.fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
                    raise
                fs = os.statvfs(SHM_DIR)
                raise SharedMemorySpaceError(
                    name, size, fs.f_bavail * fs.f_frsize, SHM_DIR
                ) from exc
            buffer = _map(shm.fd, size)
        except BaseException:
            with contextlib.suppress(posix_ipc.ExistentialError):
                shm.unlink()
            raise
        finally:
            shm.close_fd()
        return cls(name, buffer, is_creator=True)

    @classmethod
    def attach(cls, name: str, size: int) -> Segment:
        """Map the existing segment `name`, which must be exactly `size` bytes.

        Raises:
            FileNotFoundError: no such segment (its creator already unlinked it or died).
            ValueError: the segment has another size (not the ring we were told about).
        """
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError as exc:
            raise FileNotFoundError(
                f"shared-memory segment {name} does not exist: its creator died or "
                f"unlinked it before this process attached"
            ) from exc
        try:
            if shm.size != size:
                raise ValueError(
                    f"shared-memory segment {name} is {shm.size} bytes, expected {size}"
                )
            buffer = _map(shm.fd, size)
        finally:
            shm.close_fd()
        return cls(name, buffer, is_creator=False)

    def unlink(self) -> None:
        """Remove the name (creator only; idempotent). The memory lives on while mapped."""
        if self._unlinked:
            return
        self._unlinked = True
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(self.name)

    def close(self) -> None:
        """Unlink (if creator) and unmap; idempotent.

        If numpy arrays or memoryviews still export the mapping, it is unmapped when the
        last of them is released.
        """
        self.unlink()
        with contextlib.suppress(BufferError):
            self.buffer.close()
