"""Process plumbing shared by the engine process and the worker processes."""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Final

_PR_SET_PDEATHSIG: Final = 1


class ParentDiedError(RuntimeError):
    """The process that spawned us exited before we could watch it."""


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL us when the parent exits, so no engine or worker outlives its parent.

    The signal follows the parent *thread* that spawned us: the spawner must live in a
    thread that outlives us. Checking `getppid` after ``prctl`` closes the race with a
    parent that died before the call.

    Raises:
        OSError: ``prctl`` failed.
        ParentDiedError: the parent is already gone (we were re-parented).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if os.getppid() != parent_pid:
        raise ParentDiedError(f"the parent (pid {parent_pid}) exited before this process started")
