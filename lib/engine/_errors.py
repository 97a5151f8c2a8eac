"""Errors of the engine, named by cause, and `RemoteError`: what the DEAD record carries."""

from __future__ import annotations

import msgspec


class RemoteError(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """The root cause of an engine death, as it crosses to the frontend. Field order is ABI.

    `where` names the process: "engine", "worker rank 1", ...; `exit_code` and `signal` are
    set when a process exited (the supervisor saw it), the rest when an exception was caught.
    """

    where: str
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    exit_code: int | None = None
    signal: int | None = None

    def describe(self) -> str:
        """One line naming the cause: what raised or how the process ended, and where."""
        parts = [self.where]
        if self.exc_type:
            parts.append(f"raised {self.exc_type}: {self.message}")
        if self.signal is not None:
            parts.append(f"was killed by signal {self.signal}")
        elif self.exit_code is not None:
            parts.append(f"exited with code {self.exit_code}")
        return " ".join(parts)


class WorkerDiedError(RuntimeError):
    """A worker rank raised, or its process ended; `error` says which and how."""

    def __init__(self, error: RemoteError) -> None:
        super().__init__(error.describe())
        self.error = error
