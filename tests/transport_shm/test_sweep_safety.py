"""The stale-segment sweep touches only our own files and never fails a start.

Anyone can create a ``trillm-<pid>-*`` name in ``/dev/shm`` (mode 1777). A sweep run by
every `Segment.create` must leave another user's file alone (root could delete it; anyone
else would get PermissionError at every start) and skip what it may not unlink, while our
own stale files are still swept. The cases that need another user fork a child that drops
to uid 65534 (the tests run as root); where they cannot, they are skipped, and the
directory case falls back to a read-only directory of our own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from trillm.transport_shm import Segment, sweep_stale_segments

NOBODY = 65534
SHM = Path("/dev/shm")

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")


def dead_pid() -> int:
    """A pid that was a process a moment ago and is none now."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def as_user(uid: int, body: Callable[[], object], timeout: float = 30) -> object:
    """`body()`'s JSON result, run in a forked child with `uid` as its uid and gid.

    Raises:
        AssertionError: the child raised (its traceback is the message) or did not finish.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 0
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = json.dumps({"result": body()})
        except BaseException:
            code, out = 1, json.dumps({"error": traceback.format_exc()})
        with contextlib.suppress(BaseException):
            os.write(write_end, out.encode())
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()  # until the child exits (its end closes)
    _, status = os.waitpid(pid, 0)
    report = json.loads(data or b'{"error": "the child wrote nothing"}')
    assert os.waitstatus_to_exitcode(status) == 0 and "error" not in report, report.get("error")
    return report["result"]


@contextlib.contextmanager
def planted(*paths: Path) -> Iterator[None]:
    """Remove `paths` (files, links, directories) on the way out, whoever made them."""
    try:
        yield
    finally:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                if path.is_dir() and not path.is_symlink():
                    path.rmdir()
                else:
                    path.unlink()


def plant(path: Path, uid: int) -> None:
    path.write_bytes(b"\0" * 64)
    os.chown(path, uid, uid)


@needs_root
def test_a_root_owned_planted_segment_does_not_stop_another_user_from_starting() -> None:
    """The reported case: trillm running as a user, someone root-owned `trillm-<dead>-*` in
    /dev/shm. Unlinking it is EPERM (sticky directory); the sweep skips it, the user's
    Segment is created, and that user's own stale segment is still swept."""
    pid = dead_pid()
    roots = SHM / f"trillm-{pid}-00aa00aa00aa00aa"
    ours = SHM / f"trillm-{pid}-00bb00bb00bb00bb"
    with planted(roots, ours):
        plant(roots, 0)
        plant(ours, NOBODY)

        def start() -> object:
            with contextlib.closing(Segment.create(4096)) as segment:
                return segment.name

        name = as_user(NOBODY, start)
        assert isinstance(name, str) and name.startswith("/trillm-")
        assert roots.exists() and roots.stat().st_uid == 0  # left alone
        assert not ours.exists()  # swept


@needs_root
def test_root_sweeps_only_its_own_stale_segments() -> None:
    """Root could unlink anything in /dev/shm: the sweep must not delete another user's
    `trillm-*` file (nor follow a planted link, nor trip on a directory)."""
    pid = dead_pid()
    theirs = SHM / f"trillm-{pid}-0011001100110011"
    ours = SHM / f"trillm-{pid}-0022002200220022"
    link = SHM / f"trillm-{pid}-0033003300330033"
    directory = SHM / f"trillm-{pid}-0044004400440044"
    target = SHM / f"not-trillm-{pid}-target"
    with planted(theirs, ours, link, directory, target):
        plant(theirs, NOBODY)
        plant(ours, 0)
        plant(target, 0)
        link.symlink_to(target)
        directory.mkdir()
        with contextlib.closing(Segment.create(4096)):
            pass
        assert theirs.exists() and theirs.stat().st_uid == NOBODY
        assert not ours.exists()
        assert link.is_symlink() and target.exists()  # not a regular file: not ours to judge
        assert directory.is_dir()


@pytest.fixture
def shm() -> Iterator[Path]:
    """An empty directory every user can reach (under /tmp, mode 0755), ours."""
    path = Path(tempfile.mkdtemp(prefix="trillm-sweep-test-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        path.chmod(0o755)
        shutil.rmtree(path)


def test_a_segment_that_cannot_be_unlinked_is_skipped(shm: Path) -> None:
    """A stale file of ours in a directory we may not write: unlink itself fails (EACCES),
    and the sweep returns without it and without raising."""
    stuck = shm / f"trillm-{dead_pid()}-00cc00cc00cc00cc"

    def sweep() -> object:
        os.lstat(stuck)  # we see it and own it: only the unlink can fail
        assert not os.access(shm, os.W_OK)
        return sweep_stale_segments(str(shm))

    if os.geteuid() == 0:  # root may write any directory: the sweep runs as nobody
        plant(stuck, NOBODY)
        assert as_user(NOBODY, sweep) == []
    else:
        plant(stuck, os.geteuid())
        shm.chmod(0o555)
        assert sweep() == []
    assert stuck.exists()


def test_an_unreadable_directory_sweeps_nothing_and_raises_nothing(shm: Path) -> None:
    (shm / f"trillm-{dead_pid()}-00dd").write_bytes(b"x")
    shm.chmod(0o300 if os.geteuid() != 0 else 0o700)  # not listable by whoever sweeps
    sweep = lambda: sweep_stale_segments(str(shm))  # noqa: E731
    assert (as_user(NOBODY, sweep) if os.geteuid() == 0 else sweep()) == []
