"""The frontend's errors, named by cause: the engine died, a prompt does not fit, the chat
template refused the messages."""

from __future__ import annotations

from ..protocol._errors import RemoteError, death_message


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


class EngineRestartingError(EngineDeadError):
    """Every engine is restarting and did not come back within `engine_restart_wait`: the
    request was not sent (HTTP: 503 with Retry-After); retrying after `retry_after` s may
    find the engine serving again."""

    def __init__(self, error: RemoteError, waited: float, retry_after: int = 5) -> None:
        super().__init__(error)
        self.retry_after = retry_after
        self.args = (
            f"the engine is restarting (after: {death_message(error)}) and was not back "
            f"within {waited:g} s (--engine-restart-wait); retry in {retry_after} s",
        )


class PinnedEngineDeadError(EngineDeadError):
    """The engine a request was pinned to (`data_parallel_rank`) died for good while others
    serve: the request was not sent (HTTP: 503). Send it unpinned, or to another rank."""

    def __init__(self, rank: int, dead: EngineDeadError) -> None:
        super().__init__(dead.error)
        self.rank = rank
        self.args = (
            f"data_parallel_rank {rank}'s engine is dead ({dead}); send the request without "
            f"data_parallel_rank, or to a rank whose engine serves",
        )


class DataParallelRankError(ValueError):
    """A request pinned to an engine that does not exist: the caller's 400."""


class RequestFailedError(ValueError):
    """The engine refused one request (its grammar did not compile in time, ...): the
    caller's 400; the engine and the other requests go on."""


class PromptTooLongError(ValueError):
    """The prompt plus max_tokens exceed the engine's max model length; `param` names the
    request field to change ("max_tokens", or "prompt" when the prompt alone is too long)."""

    def __init__(self, message: str, param: str = "max_tokens") -> None:
        super().__init__(message)
        self.param = param


class InvalidPromptError(ValueError):
    """The prompt is empty, or holds a token id outside the vocabulary."""


class ChatTemplateError(ValueError):
    """The chat template refused the messages (its own `raise_exception`, as Gemma 2's "System
    role not supported" or Mistral's role alternation) or failed on them (an undefined name, a
    type error), or the model has none: the caller's 400, naming the template's words; nothing
    was sent to the engine."""
