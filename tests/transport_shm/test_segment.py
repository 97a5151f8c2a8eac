"""Segments never leak: kill -9 after the handshake, sweeps before it, clear ENOSPC."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import posix_ipc
import pytest

from trillm.transport_shm import (
    RingWriter,
    Segment,
    SharedMemorySpaceError,
    SharedMemoryUnavailableError,
    sweep_stale_segments,
)

from ..procs import is_dead
from .peers import Peers


def read_report(proc: subprocess.Popen[bytes]) -> dict[str, object]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the peer exited before reporting"
    report: dict[str, object] = json.loads(line)
    return report


def kill_and_wait(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while not is_dead(pid):
        assert time.monotonic() < deadline, f"process {pid} survived SIGKILL"
        time.sleep(0.005)


@pytest.mark.parametrize("creator_role", ["writer", "reader"])
@pytest.mark.parametrize("victims", ["creator", "peer", "both"])
def test_kill_9_after_handshake_leaves_nothing(
    peers: Peers, shm_names: Callable[[], set[str]], creator_role: str, victims: str
) -> None:
    proc = peers.spawn("pair", creator_role, "1")
    report = read_report(proc)
    name = str(report["name"]).lstrip("/")
    assert name not in shm_names()  # unlinked at the handshake, while both live
    creator, peer = int(str(report["creator"])), int(str(report["peer"]))
    targets = {"creator": [creator], "peer": [peer], "both": [creator, peer]}[victims]
    for pid in targets:
        kill_and_wait(pid)
    assert not {n for n in shm_names() if n.startswith(f"trillm-{creator}-")}
    for pid in (peer, creator):  # the survivor, and the peer orphaned by its creator's death
        kill_and_wait(pid)


def test_kill_9_before_handshake_is_swept_by_the_next_start(
    peers: Peers, shm_names: Callable[[], set[str]]
) -> None:
    proc = peers.spawn("pair", "writer", "0")
    name = str(read_report(proc)["name"]).lstrip("/")
    assert name in shm_names()
    assert os.stat(f"/dev/shm/{name}").st_mode & 0o777 == 0o600
    proc.kill()
    proc.wait(10)
    assert name in shm_names()  # leaked by the kill ...
    with RingWriter.create(4096):  # ... until the next start sweeps it
        assert name not in shm_names()


def test_sweep_keeps_segments_of_live_processes(shm_names: Callable[[], set[str]]) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"/trillm-{dead.pid}-00ff"
    live = f"/trillm-{os.getpid()}-00ff"
    for name in (stale, live):
        posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, size=64).close_fd()
    try:
        removed = sweep_stale_segments()
        assert stale.lstrip("/") in removed
        assert live.lstrip("/") in shm_names()
    finally:
        for name in (stale, live):
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(name)


def test_too_large_segment_fails_at_creation_naming_size_and_free_space(
    shm_names: Callable[[], set[str]],
) -> None:
    stat = os.statvfs("/dev/shm")
    size = stat.f_blocks * stat.f_frsize + 4096
    before = shm_names()
    with pytest.raises(SharedMemorySpaceError, match=rf"cannot reserve {size} bytes .* free"):
        Segment.create(size)
    assert shm_names() == before


# What shm_open(3) answers with /dev/shm missing (ENOENT), not ours (EACCES) or read-only.
NO_SHM = [posix_ipc.ExistentialError, posix_ipc.PermissionsError, OSError]


@pytest.mark.parametrize("error", NO_SHM, ids=lambda e: e.__name__)
def test_no_usable_dev_shm_fails_at_creation_naming_it(
    monkeypatch: pytest.MonkeyPatch, error: type[Exception]
) -> None:
    """Issue 48, item 4: a machine without /dev/shm (a bare VM image) must say so."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise error("No such file or directory")

    monkeypatch.setattr(posix_ipc, "SharedMemory", refuse)
    with pytest.raises(SharedMemoryUnavailableError, match=r"rings live in /dev/shm, which must"):
        Segment.create(4096)


def test_trillm_serve_without_dev_shm_fails_at_start_in_one_line(tmp_path: Path) -> None:
    """The whole server: one line naming /dev/shm and how to mount it, exit 1, no traceback."""
    script = tmp_path / "no_shm.py"
    script.write_text(
        "import sys, posix_ipc\n"
        "real = posix_ipc.SharedMemory\n"
        "def shm(name, flags=0, *a, **k):\n"
        "    if flags & posix_ipc.O_CREAT:\n"
        "        raise posix_ipc.ExistentialError('No such file or directory')\n"
        "    return real(name, flags, *a, **k)\n"
        "posix_ipc.SharedMemory = shm\n"
        "from trillm.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    args = [sys.executable, str(script), "serve", "--executor", "null", "--port", "0"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("trillm serve: ")]
    assert "cannot create shared-memory segment" in line and "mount -t tmpfs" in line


def test_attach_to_a_missing_segment_says_why() -> None:
    with pytest.raises(FileNotFoundError, match="its creator died or unlinked it"):
        Segment.attach("/trillm-1-doesnotexist", 4096)
