"""A heartbeat thread: bumps a ring end's heartbeat word, so a peer can tell it is alive.

A thread, not the caller's loop: a healthy long call (a forward pass, a model load) would
otherwise look like a death. What stops the thread stops its process (SIGSTOP, a freezer, a
native call holding the GIL throughout), which is what a watchdog in the peer must catch.
"""

from __future__ import annotations

import threading
from typing import Protocol, Self


class Beating(Protocol):
    def beat(self) -> None: ...


class Heartbeat:
    """Beats `ring` every `interval` seconds from a daemon thread while the block runs.

    Leave the block before the ring is closed: a beat after `close` would touch unmapped
    memory (the thread stops at the first error instead).
    """

    def __init__(self, ring: Beating, interval: float, name: str = "trillm-heartbeat") -> None:
        self._ring = ring
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> Self:
        self._ring.beat()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._ring.beat()
            except (ValueError, TypeError):  # the ring was closed under us: nothing to show
                return
