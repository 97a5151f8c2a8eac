"""Process plumbing shared by every process: the frontend, the engine and the workers.

No torch and nothing of trillm: the API process reads a child's state with it too."""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Final

_PR_SET_PDEATHSIG: Final = 1
_PR_SET_NAME: Final = 15
_COMM_BYTES: Final = 15  # TASK_COMM_LEN less the NUL


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


_PF_EXITING: Final = 0x4  # include/linux/sched.h: set when do_exit() begins


def is_exiting(pid: int) -> bool:
    """Whether process `pid` has begun to exit (or is gone), though it may not be reaped yet.

    Why: a killed process closes its sockets before its pidfd turns readable, so a peer's
    "connection reset" can be seen before the death itself. A supervisor that takes "pidfd not
    readable" for "alive" then blames the peer. The kernel flags the task `PF_EXITING` at the
    start of `do_exit()`, before it closes any file, and /proc shows it.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return True
    fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
    return fields[0] in (b"Z", b"X") or bool(int(fields[6]) & _PF_EXITING)


def process_state(pid: int) -> str:
    """The process's scheduler state from /proc ("T (stopped)", "R (running)", ...), or ""."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def set_title(title: str) -> None:
    """Name this process `title` in `ps`, `top` and py-spy (trillm::api, trillm::engine, ...).

    A nicety, never a reason to fail: `setproctitle` rewrites the whole command line where it
    is installed; where it is not (a lent GPU machine's image lacks it), the kernel's short
    name (/proc/self/comm, 15 bytes, what `top` and `ps -o comm` show) is set instead, and a
    failure of that is ignored too. Imported here, not at module top, so that a missing
    package cannot stop a process from starting.
    """
    try:
        import setproctitle
    except ImportError:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, title.encode()[:_COMM_BYTES], 0, 0, 0)
        return
    setproctitle.setproctitle(title)
