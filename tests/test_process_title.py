"""trillm.common.process.set_title: the process's name with setproctitle, and without it (a lent GPU
machine's image lacks it) the kernel's short name; never an error. Each case runs in a fresh
interpreter, since a title, once set, stays for the process's life."""

from __future__ import annotations

import subprocess
import sys

import pytest

SET_AND_READ = """
import sys
{hide}
from trillm.common.process import set_title
set_title(sys.argv[1])
print(open("/proc/self/comm").read().strip())
print(open("/proc/self/cmdline", "rb").read().split(b"\\0")[0].decode())
"""
HIDE = "sys.modules['setproctitle'] = None  # `import setproctitle` raises ImportError"


def titled(title: str, *, hide: bool) -> list[str]:
    code = SET_AND_READ.format(hide=HIDE if hide else "")
    proc = subprocess.run(
        [sys.executable, "-c", code, title], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_with_setproctitle_the_command_line_is_the_title() -> None:
    pytest.importorskip("setproctitle")
    comm, cmdline = titled("trillm::worker_3", hide=False)
    assert cmdline == "trillm::worker_3"
    assert comm == "trillm::worker_"  # setproctitle sets the kernel's 15 bytes too


def test_without_setproctitle_the_kernel_name_is_set_and_nothing_fails() -> None:
    comm, cmdline = titled("trillm::worker_3", hide=True)
    assert comm == "trillm::worker_"
    assert cmdline == sys.executable  # unchanged: only setproctitle rewrites it


def test_no_module_imports_setproctitle_at_top() -> None:
    """The device image lacks it: a module-top import would stop `trillm serve` and pytest."""
    from pathlib import Path

    lib = Path(__file__).resolve().parents[1] / "lib"
    offenders = [
        str(path.relative_to(lib))
        for path in sorted(lib.rglob("*.py"))
        if any(
            line.startswith(("import setproctitle", "from setproctitle"))
            for line in path.read_text().splitlines()
        )
    ]
    assert offenders == []
