"""An eventfd doorbell: how a ring's sleeping side is woken.

An eventfd is one kernel counter behind a file descriptor: `ring` adds one (a ``write``),
a wait sleeps until it is non-zero, and the waiter resets it (a ``read``) before it next
sleeps. Because it is an fd, a trio
task waits for it with `trio.lowlevel.wait_readable` (no thread), and a plain thread blocks on
it with ``poll`` and a timeout. It is inherited by child processes through ``pass_fds``, so it
has no name to leak. The ring rings it only when its waiter said it is about to sleep (the
eventcount in `_ring`), so a busy stream makes no system call here.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import time

import trio

from ._errors import BusyError


class Doorbell:
    """One eventfd, rung by one side and waited on by the other."""

    def __init__(self, fd: int | None = None) -> None:
        """Wrap `fd` (an inherited eventfd), or create a new one."""
        if fd is None:
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:
            os.set_blocking(fd, False)
        self.fd = fd
        self._closed = False

    def ring(self) -> None:
        """Wake the waiter (a no-op once closed: the peer is gone or we are)."""
        if self._closed:
            return
        try:
            os.eventfd_write(self.fd, 1)
        except OSError:  # EBADF after a racing close: the waiter is gone anyway
            if not self._closed:
                raise

    def clear(self) -> None:
        """Reset the counter; a sleeper calls this *before* it announces that it sleeps.

        Clearing on the way to sleep, not after waking, keeps the ``read`` system call off
        the wake-up path: a woken waiter returns at once and the fd stays readable until its
        next sleep.
        """
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass
        except OSError:
            if not self._closed:
                raise

    def wait(self, timeout: float | None) -> None:
        """Block the thread until rung; `timeout` as in posix-ipc (None, 0, > 0 seconds).

        Raises:
            BusyError: not rung within `timeout`.
            trio.ClosedResourceError: this doorbell was closed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while True:
            if self._closed:
                raise trio.ClosedResourceError("the doorbell was closed")
            left = None if deadline is None else deadline - time.monotonic()
            if poller.poll(None if left is None else max(0, math.ceil(left * 1000))):
                return
            if left is not None and deadline is not None and time.monotonic() >= deadline:
                raise BusyError(f"the doorbell was not rung within {timeout} s")

    async def wait_async(self) -> None:
        """Sleep the trio task until rung (cancellable).

        Raises:
            trio.ClosedResourceError: this doorbell was closed, also while waiting.
        """
        if self._closed:
            raise trio.ClosedResourceError("the doorbell was closed")
        await trio.lowlevel.wait_readable(self.fd)

    def close(self) -> None:
        """Close the fd, waking a trio task that waits on it (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):  # wakes a thread blocked in `wait` too
            os.eventfd_write(self.fd, 1)
        with contextlib.suppress(RuntimeError):  # not inside trio: no task can wait on it
            trio.lowlevel.notify_closing(self.fd)
        os.close(self.fd)
