"""Starting the engine process: its rings, its command line, and the wait for READY.

The frontend creates both rings (it owns their names until the engine attached), spawns a
fresh interpreter running the engine's entry point by name (`ENGINE_MAIN`: the frontend never
imports the engine's code) with the rings' doorbell fds inherited, and waits for the
handshake and the READY record, noticing at once if the child died instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import msgspec

from ....transport_shm import BusyError, RingReader, RingWriter
from ...protocol import _messages as P
from ...protocol._config import EngineArgs, EngineConfig
from ...protocol._errors import RemoteError
from ._connection import EngineConnection


class EngineStartError(RuntimeError):
    """The engine process failed before READY; `error` is its root cause."""

    def __init__(self, error: RemoteError) -> None:
        super().__init__(f"the engine failed to start: {error.describe()}")
        self.error = error


def spawn_engine(config: EngineConfig) -> tuple[subprocess.Popen[bytes], RingWriter, RingReader]:
    """Create the rings and start the engine process (not yet attached or ready)."""
    requests = RingWriter.create(config.request_ring_bytes)
    outputs = RingReader.create(config.output_ring_bytes)
    args = EngineArgs(config, requests.address, outputs.address, os.getpid())
    try:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                P.ENGINE_MAIN,
                msgspec.json.encode(args).decode(),
            ],
            pass_fds=(*requests.address.fds, *outputs.address.fds),
        )
    except BaseException:
        requests.close()
        outputs.close()
        raise
    return process, requests, outputs


def exit_error(process: subprocess.Popen[bytes]) -> RemoteError:
    """How the engine process ended, as a root cause."""
    return exit_cause(process.returncode)


def exit_cause(code: int | None) -> RemoteError:
    """An exit status (negative: the signal that killed it; None: not known) as a root cause."""
    if code is not None and code < 0:
        return RemoteError("engine", signal=-code)
    return RemoteError("engine", exit_code=code)


def wait_ready(
    process: subprocess.Popen[bytes], requests: RingWriter, outputs: RingReader, timeout: float
) -> P.Ready:
    """Wait for the handshake and READY; raise `EngineStartError` with the cause otherwise."""
    deadline = time.monotonic() + timeout
    for ring in (requests, outputs):
        while True:
            try:
                ring.wait_attached(timeout=0.05)
                break
            except BusyError:
                if process.poll() is not None:
                    raise EngineStartError(exit_error(process)) from None
                if time.monotonic() > deadline:
                    raise EngineStartError(
                        RemoteError("engine", "TimeoutError", f"no handshake within {timeout} s")
                    ) from None
    while True:
        try:
            kind, payload = outputs.peek(timeout=0.05)
        except BusyError:
            if process.poll() is not None:
                outputs.declare_peer_dead(exit_error(process).describe())
                continue  # read a DEAD it may have written first
            if time.monotonic() > deadline:
                raise EngineStartError(
                    RemoteError("engine", "TimeoutError", f"not ready within {timeout} s")
                ) from None
            continue
        except Exception:
            raise EngineStartError(exit_error(process)) from None
        ready = EngineConnection().ready(kind, payload)
        outputs.release()
        if isinstance(ready, RemoteError):
            raise EngineStartError(ready)
        return ready
