"""`RemoteError`: the root cause of a death as the DEAD record carries it across processes."""

from __future__ import annotations

import signal

import msgspec


class RemoteError(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """The root cause of an engine death, as it crosses to the frontend. Field order is ABI.

    `where` names the process: "engine", "worker rank 1", ...; `exit_code` and `signal` are
    set when a process exited (the supervisor saw it), the rest when an exception was caught.
    `step_rnums` lets the frontend tell a request that kills every engine it runs on (a
    poison request) from the ones that merely shared its batch.
    """

    where: str
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    exit_code: int | None = None
    signal: int | None = None
    function: str = ""  # where the exception was raised: "Class.method (file.py:line)"
    # The requests (rnums) of the step that raised, when the death came from inside a step
    # (the engine's own exception or a worker rank's); None: unknown (a signal, a stall).
    step_rnums: list[int] | None = None

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


def death_message(error: RemoteError) -> str:
    """The root cause in words: "engine process killed by signal 9 (SIGKILL)",
    "RuntimeError in worker rank 1, raised in Sampler.forward (_sampler.py:80): <message>",
    "engine process exited with code 3"."""
    if error.signal is not None:
        try:
            name = f" ({signal.Signals(error.signal).name})"
        except ValueError:
            name = ""
        return f"{error.where} process killed by signal {error.signal}{name}"
    if error.exc_type:
        raised = f", raised in {error.function}" if error.function else ""
        return f"{error.exc_type} in {error.where}{raised}: {error.message}"
    return f"{error.where} process exited with code {error.exit_code}"
