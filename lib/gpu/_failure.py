"""How a worker reports its own death: a record of the exception, for the executor to relay.

The engine turns it into its DEAD record's `RemoteError`; it lives here because the worker
process (gpu) may not import the engine.
"""

from __future__ import annotations

import traceback

import msgspec


class WorkerFailure(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """An exception raised in a worker. Field order is wire ABI."""

    rank: int
    exc_type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> WorkerFailure:
        return cls(
            rank,
            type(exc).__qualname__,
            str(exc),
            "".join(traceback.format_exception(exc)),
        )


class InjectedFault(RuntimeError):
    """Raised by the `inject_fault` test hook (WorkerConfig), never otherwise."""
