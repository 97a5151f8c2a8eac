"""The HTTP server's one error type and OpenAI's error body.

Every failure the server answers with a status other than 200 is a `RequestError`, raised as
deep as the cause is known (decoding, validation, routing, admission) and turned into a body
in one place. The body is OpenAI's: `{"error": {"message", "type", "param", "code"}}`, so the
official SDKs raise their typed exceptions (`BadRequestError`, `NotFoundError`, ...) with our
message, and their retry logic honours our `Retry-After`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import msgspec

from ...engine.client import (
    ChatTemplateError,
    DataParallelRankError,
    EngineDeadError,
    EngineRestartingError,
    InvalidPromptError,
    PromptEmbedsError,
    PromptTooLongError,
    RequestFailedError,
    StructuredOutputError,
)

# OpenAI's `type` by status; statuses not listed are server errors.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_exceeded",
}
SERVER_ERROR = "server_error"


class RequestError(Exception):
    """A request the server answers with an error status and OpenAI's error body.

    Attributes:
        status: the HTTP status (400 for the caller's mistakes).
        message: what went wrong and what to do; it names the field, the value and the limit.
        type: OpenAI's error type ("invalid_request_error", ...), derived from the status
            unless given.
        param: the request field at fault, or None.
        code: a machine-readable code ("model_not_found", ...), or None.
        headers: extra response headers (`Retry-After`, `WWW-Authenticate`).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ERROR_TYPES.get(status, SERVER_ERROR)
        self.param = param
        self.code = code
        self.headers: dict[str, str] = dict(headers or {})

    def __repr__(self) -> str:
        return f"RequestError({self.status}, {self.message!r}, param={self.param!r})"


class _ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class _ErrorBody(msgspec.Struct):
    error: _ErrorInfo


_encoder = msgspec.json.Encoder()


def error_body(err: RequestError) -> bytes:
    """OpenAI's JSON error body for `err` (null `param` and `code` included, as OpenAI)."""
    return _encoder.encode(_ErrorBody(_ErrorInfo(err.message, err.type, err.param, err.code)))


@contextmanager
def fields_renamed(renames: Mapping[str, str]) -> Iterator[None]:
    """Errors raised inside name the fields as the client sent them: an API translated into a
    chat request (`max_tokens` is the Responses API's `max_output_tokens`) reports its own."""
    try:
        yield
    except Exception as exc:
        err = http_error(exc)
        if err is None or err.param is None:
            raise
        head, sep, rest = err.param.partition(".")
        renamed = renames.get(err.param) or renames.get(head)
        if renamed is None:
            raise
        param = renamed if renames.get(err.param) else renamed + sep + rest
        message = err.message.replace(err.param, param, 1)
        raise RequestError(
            err.status, message, err.type, param=param, code=err.code, headers=err.headers
        ) from err


def not_found(what: str, *, param: str | None = None, code: str | None = None) -> RequestError:
    """404: `what` (e.g. "the model 'gpt-4'") does not exist."""
    return RequestError(404, f"{what} does not exist", param=param, code=code)


def too_large(limit: int, size: int | None = None) -> RequestError:
    """413: the request body is over `limit` bytes (`size`, if known, is how big it is)."""
    got = f" (got {size} bytes)" if size is not None else ""
    return RequestError(
        413,
        f"the request body is larger than the limit of {limit} bytes{got}; send a smaller one",
        code="request_too_large",
    )


def unauthorized() -> RequestError:
    """401: the API key is missing or wrong."""
    return RequestError(
        401,
        "the API key is missing or invalid: send it as the header 'Authorization: Bearer <key>' "
        "(or 'x-api-key: <key>', as Anthropic's clients do)",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def overloaded(retry_after: float) -> RequestError:
    """429: the server has no room for another request now; retry after `retry_after` s.

    `Retry-After` is whole seconds (HTTP allows no fraction), rounded up and at least 1.
    """
    seconds = max(1, math.ceil(retry_after))
    return RequestError(
        429,
        f"the server is overloaded: too many requests are waiting; retry after {seconds} s",
        code="overloaded",
        headers={"Retry-After": str(seconds)},
    )


def http_error(exc: BaseException) -> RequestError | None:
    """The HTTP error an exception stands for, the same before a response starts (its status
    and body) and inside a stream (the error event's body); None for a failure of ours, which
    the caller logs and answers with a 500.

    An engine's death is a 503 (`server_error`: the server cannot serve now; a restart or
    another replica may), with `Retry-After` when every engine (or a request's pinned one) is
    restarting; so is the death of the engine a request was pinned to (`data_parallel_rank`).
    """
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, EngineRestartingError):
        retry = {"Retry-After": str(exc.retry_after)}
        return RequestError(503, str(exc), SERVER_ERROR, headers=retry)
    if isinstance(exc, EngineDeadError):
        return RequestError(503, str(exc), SERVER_ERROR)
    if isinstance(exc, PromptTooLongError):
        return RequestError(400, str(exc), param=exc.param)
    if isinstance(exc, InvalidPromptError):
        return RequestError(400, str(exc), param="prompt")
    if isinstance(exc, PromptEmbedsError):
        return RequestError(400, str(exc), param="prompt_embeds")
    if isinstance(exc, DataParallelRankError):
        return RequestError(400, str(exc), param="data_parallel_rank")
    if isinstance(exc, ChatTemplateError):  # the prompt is rendered before any stream starts
        return RequestError(400, str(exc), param="messages")
    if isinstance(exc, StructuredOutputError):
        return RequestError(400, str(exc), param=exc.field)
    if isinstance(exc, RequestFailedError):  # the engine refused this request alone
        return RequestError(400, str(exc))
    return None


def internal_error(exc: BaseException) -> RequestError:
    """500 for a failure of ours (the caller logs its traceback)."""
    return RequestError(500, f"internal error: {exc}", SERVER_ERROR)
