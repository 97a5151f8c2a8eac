"""An in-process engine (`--engine-in-process`, vLLM's `InprocClient`): for debugging.

The engine core runs on a thread of the frontend's process, behind the same rings and the
same client (`EngineClient`): one `py-spy dump` shows the API server's trio loop and the
engine's busy loop together, and a debugger stops both. The engine code is loaded by its
entry point's name (`ENGINE_MAIN`, as the process launch runs it), so the frontend still
imports nothing of the engine at import time.

What differs from a process: nothing can kill a thread, so the watchdog is off (a stalled
engine is not detected) and a shutdown that the engine does not honour in time leaves the
thread behind (a daemon: it ends with the process); the engine shares the frontend's GIL,
title, signals and parent. Its death is the same DEAD record, so the same
`EngineDeadError` with the root cause.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Protocol

from ....transport_shm import RingReader, RingWriter
from ...protocol import _messages as P
from ...protocol._config import EngineArgs, EngineConfig


class EngineProcess(Protocol):
    """What `EngineClient` uses of its engine: a `subprocess.Popen`, or an `EngineThread`."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self) -> int | None: ...

    def kill(self) -> None: ...


class EngineThread:
    """The engine's `serve` on a daemon thread, shaped like the part of `Popen` the client
    uses: `pid` is this process's, `returncode` is `serve`'s (1: it died, DEAD written)."""

    def __init__(self, args: EngineArgs, on_exit: Callable[[], None]) -> None:
        self.pid = os.getpid()
        self.returncode: int | None = None
        self._args = args
        self._on_exit = on_exit
        self._abandoned = False
        self._thread = threading.Thread(target=self._run, name="trillm::engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        code = 1
        try:
            code = importlib.import_module(P.ENGINE_MAIN).serve(self._args)
        except BaseException:  # the engine code would not load: no DEAD record was written
            traceback.print_exc(file=sys.stderr)
        finally:
            self.returncode = code
            self._on_exit()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self) -> int | None:
        """The return code once the thread ended; after `kill`, at once (None if running)."""
        if not self._abandoned:
            self._thread.join()  # called once it returned (`on_exit`): a moment at most
        return self.returncode

    def kill(self) -> None:
        """A thread cannot be killed: stop waiting for it (the daemon thread ends with the
        process)."""
        self._abandoned = True


def start_in_process(
    config: EngineConfig, on_exit: Callable[[], None]
) -> tuple[EngineThread, RingWriter, RingReader]:
    """Create the rings and start the engine on a thread (not yet attached or ready);
    `on_exit` is called from that thread when the engine returns."""
    requests = RingWriter.create(config.request_ring_bytes)
    outputs = RingReader.create(config.output_ring_bytes)
    # Each end owns the fds it attached with: the engine's ends get their own copies.
    args = EngineArgs(config, requests.address.dup(), outputs.address.dup(), os.getpid())
    thread = EngineThread(args, on_exit)
    try:
        thread.start()
    except BaseException:
        requests.close()
        outputs.close()
        raise
    return thread, requests, outputs
