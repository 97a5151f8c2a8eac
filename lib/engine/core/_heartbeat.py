"""The engine process's heartbeat: proof of life for the frontend's watchdog.

The engine bumps the heartbeat word of its output ring from a thread of its own, every
`HEARTBEAT_INTERVAL` seconds, from before the model loads until the process ends. The
frontend's watchdog (`client._watchdog`) declares the engine dead when the word has not moved
for its timeout.

Why a thread and not the busy loop: a healthy forward pass (a long prefill on CPU, a first
CUDA kernel compile) or a model load may take longer than any timeout worth having, and the
loop does not come up for air during it; a beating loop would make a slow step a death.
What stops the thread stops the whole process: SIGSTOP (a debugger, a cgroup freezer, a
terminal's Ctrl-Z), a kernel that no longer schedules it, or a native call that holds the
GIL for the whole timeout. What it does not catch is a loop stuck with the GIL released
while the process runs (a collective waiting on a live but hung peer): the pidfd supervisors
and the per-rank result rings catch the dead-peer cases, a hung live peer remains undetected
(docs/design.md).
"""

from __future__ import annotations

from ...transport_shm import Heartbeat as _RingHeartbeat
from ...transport_shm import RingWriter
from ..protocol._messages import HEARTBEAT_INTERVAL


class Heartbeat(_RingHeartbeat):
    """Beats the engine's output ring every `HEARTBEAT_INTERVAL` while the block runs."""

    def __init__(self, ring: RingWriter, interval: float = HEARTBEAT_INTERVAL) -> None:
        super().__init__(ring, interval)
