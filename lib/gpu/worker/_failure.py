"""How a worker reports its own death: a record of the exception, for the executor to relay.

The engine turns it into its DEAD record's `RemoteError`; it lives here because the worker
process (gpu) may not import the engine.
"""

from __future__ import annotations

import os
import traceback

import msgspec

# lib/, the trillm package: this module is lib/gpu/worker/_failure.py
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


class WorkerFailure(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """An exception raised in a worker. Field order is wire ABI."""

    rank: int
    exc_type: str
    message: str
    traceback: str
    function: str = ""  # `raised_in(exc)`

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> WorkerFailure:
        return cls(
            rank,
            type(exc).__qualname__,
            str(exc),
            "".join(traceback.format_exception(exc)),
            raised_in(exc),
        )


def raised_in(exc: BaseException) -> str:
    """The function `exc` was raised in, as "Class.method (file.py:line)", or "".

    The innermost frame in trillm's own code, else the innermost frame: an error inside torch
    is raised many frames below the trillm function that called it, which says more.
    """
    frames = list(traceback.walk_tb(exc.__traceback__))
    if not frames:
        return ""
    ours = [(f, line) for f, line in frames if f.f_code.co_filename.startswith(_PACKAGE_DIR)]
    frame, line = (ours or frames)[-1]
    code = frame.f_code
    return f"{code.co_qualname} ({os.path.basename(code.co_filename)}:{line})"


class InjectedFault(RuntimeError):
    """Raised by the `inject_fault` test hook (WorkerConfig), never otherwise."""
