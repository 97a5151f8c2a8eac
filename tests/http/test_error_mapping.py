"""One mapping from the engine client's exceptions to HTTP errors (`_errors.http_error`), used
both before a response starts (its status) and inside a stream (the error event's body)."""

from __future__ import annotations

import pytest

from trillm.engine.client import (
    ChatTemplateError,
    DataParallelRankError,
    EngineDeadError,
    EngineRestartingError,
    InvalidPromptError,
    PinnedEngineDeadError,
    PromptTooLongError,
    RemoteError,
    RequestFailedError,
    StructuredOutputError,
)
from trillm.http.edge._errors import RequestError, http_error

DEATH = RemoteError("engine", signal=9)


@pytest.mark.parametrize(
    ("exc", "status", "param"),
    [
        (EngineDeadError(DEATH), 503, None),
        (EngineRestartingError(DEATH, 30.0), 503, None),
        (PromptTooLongError("too long"), 400, "max_tokens"),
        (PromptTooLongError("head too long", param="prompt"), 400, "prompt"),
        (InvalidPromptError("empty"), 400, "prompt"),
        (ChatTemplateError("refused"), 400, "messages"),
        (StructuredOutputError("response_format", "bad schema"), 400, "response_format"),
        (RequestFailedError("grammar timed out"), 400, None),
        (DataParallelRankError("rank 2 of 2"), 400, "data_parallel_rank"),
        (PinnedEngineDeadError(1, EngineDeadError(DEATH)), 503, None),
    ],
)
def test_each_cause_has_one_status_and_field(exc: Exception, status: int, param: str) -> None:
    error = http_error(exc)
    assert error is not None
    assert (error.status, error.param, error.message) == (status, param, str(exc))


def test_a_death_is_a_server_error_and_a_restart_says_when_to_retry() -> None:
    dead = http_error(EngineDeadError(DEATH))
    restarting = http_error(EngineRestartingError(DEATH, 30.0, retry_after=5))
    assert dead is not None and dead.type == "server_error" and not dead.headers
    assert restarting is not None and restarting.headers == {"Retry-After": "5"}


def test_our_own_failures_are_not_mapped_and_request_errors_pass_through() -> None:
    assert http_error(KeyError("bug")) is None
    error = RequestError(413, "too large")
    assert http_error(error) is error
