"""The engine process's errors, named by cause: a worker rank failed."""

from __future__ import annotations

from ..protocol._errors import RemoteError


class WorkerDiedError(RuntimeError):
    """A worker rank raised, or its process ended; `error` says which and how."""

    def __init__(self, error: RemoteError) -> None:
        super().__init__(error.describe())
        self.error = error
