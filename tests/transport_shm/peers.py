"""Spawning peer.py processes for the transport tests."""

from __future__ import annotations

import os
import subprocess
import sys

PEER = os.path.join(os.path.dirname(__file__), "peer.py")


class Peers:
    """Spawns peer.py processes and kills whatever is left at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, *args: str, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, PEER, *args], pass_fds=pass_fds, stdout=subprocess.PIPE
        )
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            if proc.stdout:
                proc.stdout.close()
