"""Errors of the engine, named by cause, and `RemoteError`: what the DEAD record carries."""

from __future__ import annotations

import signal

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
    function: str = ""  # where the exception was raised: "Class.method (file.py:line)"

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


class RemoteTraceback(Exception):
    """The traceback of an exception raised in another process, as text (the `__cause__`)."""


class EngineDeadError(RuntimeError):
    """The engine died: every open request and every later call raises this.

    The message names the root cause; `error` holds it whole, and a remote traceback, when
    there is one, is attached as `__cause__`.
    """

    def __init__(self, error: RemoteError) -> None:
        super().__init__(f"the engine died: {death_message(error)}")
        self.error = error
        if error.traceback:
            self.__cause__ = RemoteTraceback(error.traceback)


class WorkerDiedError(RuntimeError):
    """A worker rank raised, or its process ended; `error` says which and how."""

    def __init__(self, error: RemoteError) -> None:
        super().__init__(error.describe())
        self.error = error


class PromptTooLongError(ValueError):
    """The prompt plus max_tokens exceed the engine's max model length."""
