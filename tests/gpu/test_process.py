"""Process plumbing: telling a process that has begun to exit from a live one."""

from __future__ import annotations

import os
import subprocess
import sys

from trillm.common.process import is_exiting


def test_a_live_process_is_not_exiting() -> None:
    assert not is_exiting(os.getpid())


def test_an_exited_unreaped_process_is_exiting_before_anyone_reaps_it() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        assert is_exiting(child.pid)
    finally:
        child.wait()
    assert is_exiting(child.pid)  # reaped: gone (pid numbers are not reused this fast)


def test_the_comm_field_cannot_confuse_the_parser() -> None:
    # A command name with spaces and parentheses, as /proc/PID/stat shows it: "(a) S 1 (b)".
    script = (
        "import sys, time\n"
        "open('/proc/self/comm', 'w').write('a) S 1 (b')\n"
        "print('named', flush=True)\n"
        "time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"named\n"
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            assert b"(a) S 1 (b)" in f.read()
        assert not is_exiting(child.pid)
    finally:
        child.kill()
        child.wait()
