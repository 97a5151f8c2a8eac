"""The Messages API's reply: a turn's blocks as Anthropic's content blocks, whole or as SSE.

A reasoning block is a `thinking` block (its `signature` empty: nothing here signs), a text
block a `text` block, a tool call a `tool_use` block whose `id` is the call's id under
Anthropic's prefix (`toolu_`), the same at its start and in the whole message. A stream is
Anthropic's event sequence: `message_start` (the message with no content, its usage what is
known before any output: nothing), `ping`; per block `content_block_start` (an empty block),
its deltas (`text_delta`, `thinking_delta`, `input_json_delta` with the call's arguments
whole), `content_block_stop`; then `message_delta` (the stop reason and the turn's usage,
`input_tokens` included) and `message_stop`, or an `error` event. Errors have Anthropic's
shape, `{"type": "error", "error": {"type", "message"}}`, with its types by status.
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

from ..edge._errors import RequestError
from ..turn._partial_json import parse_partial
from ..turn._turn import Block, BlockEvent, TurnBlocks

_encode = msgspec.json.Encoder().encode
# Anthropic's error `type` by status; another 4xx is an invalid request, another 5xx api_error.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
EMPTY_BLOCKS: dict[str, dict[str, Any]] = {
    "text": {"type": "text", "text": ""},
    "reasoning": {"type": "thinking", "thinking": "", "signature": ""},
}
DELTAS = {"text": ("text_delta", "text"), "reasoning": ("thinking_delta", "thinking")}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    default = "invalid_request_error" if 400 <= status < 500 else "api_error"
    return ERROR_TYPES.get(status, default)


def anthropic_error_body(err: RequestError) -> bytes:
    """Anthropic's JSON error body for `err` (its message names the field at fault)."""
    return _encode(_error(err))


def count_tokens_response(n: int) -> bytes:
    """The body of `/v1/messages/count_tokens`: `n` prompt tokens."""
    return _encode({"input_tokens": n})


class MessagesFace:
    """One message's wire shape: its id, and whether its usage shows prefix-cache hits.

    Prefix-cache hits tell a client what others sent before, so `cache_read_input_tokens`
    is reported only with `cached_details` (--enable-prompt-tokens-details, as chat's).
    """

    def __init__(self, model: str, *, cached_details: bool = False) -> None:
        self.model = model
        self.cached_details = cached_details
        self.id = "msg_" + secrets.token_hex(12)

    # -- whole -------------------------------------------------------------------------

    def whole(self, turn: TurnBlocks) -> bytes:
        """The message's body.

        Raises:
            RequestError: 503 or 500 when the engine ended the turn before its end.
        """
        _check_finished(turn)
        content = [_content_block(b) for b in turn.blocks]
        stop_reason, stop_sequence = _stop(turn)
        return _encode(self._message(turn, content, stop_reason, stop_sequence))

    # -- stream ------------------------------------------------------------------------

    def started(self, turn: TurnBlocks) -> bytes:
        message = self._message(turn, [], None, None)
        return _event("message_start", message=message) + _event("ping")

    def events(self, turn: TurnBlocks, events: list[BlockEvent]) -> bytes:
        return b"".join(_block_event(event) for event in events)

    def ended(self, turn: TurnBlocks) -> bytes:
        try:
            _check_finished(turn)
        except RequestError as err:
            return self.failed(turn, err)
        stop_reason, stop_sequence = _stop(turn)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        usage = self._usage(turn)
        return _event("message_delta", delta=delta, usage=usage) + _event("message_stop")

    def failed(self, turn: TurnBlocks, error: RequestError) -> bytes:
        return _event("error", error=_error(error)["error"])

    # -- the message -------------------------------------------------------------------

    def _message(
        self,
        turn: TurnBlocks,
        content: list[dict[str, Any]],
        stop_reason: str | None,
        stop_sequence: str | None,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": self._usage(turn),
        }

    def _usage(self, turn: TurnBlocks) -> dict[str, Any]:
        c = turn.counts
        usage: dict[str, Any] = {"input_tokens": c.prompt_tokens, "output_tokens": c.output_tokens}
        if self.cached_details:
            # Anthropic's input_tokens leave out cache reads. Every computed prompt token is
            # cached, but none at a client's breakpoint: none counts as a cache write.
            usage["input_tokens"] = c.prompt_tokens - c.cached_tokens
            usage["cache_read_input_tokens"] = c.cached_tokens
            usage["cache_creation_input_tokens"] = 0
        usage["output_tokens_details"] = {"thinking_tokens": c.reasoning_tokens}
        return usage


def _check_finished(turn: TurnBlocks) -> None:
    """Raise when the engine ended the turn itself (no stop reason of Anthropic's says so)."""
    if turn.finish_reason == "abort":
        raise RequestError(
            503,
            "the engine aborted the request before it finished (it was put to sleep, reset or "
            "restarted); retry it",
            "server_error",
        )
    if turn.finish_reason == "error":
        raise RequestError(500, "the engine failed the request before it finished", "server_error")


def _stop(turn: TurnBlocks) -> tuple[str, str | None]:
    """The stop reason, and the stop sequence that ended the turn (if one did)."""
    if turn.finish_reason == "length":
        return "max_tokens", None
    if turn.called:
        return "tool_use", None
    if isinstance(turn.stop_reason, str):  # a stop string (an int is a stop token)
        return "stop_sequence", turn.stop_reason
    return "end_turn", None


def _tool_use_id(block: Block) -> str:
    assert block.call is not None  # a tool_call block carries its call
    return "toolu_" + block.call.id.removeprefix("call_")


def _content_block(block: Block) -> dict[str, Any]:
    if block.kind == "tool_call":
        assert block.call is not None
        # The arguments are the parser's JSON text (`json.dumps`): embedded as they are; a call
        # the token limit cut off has the object its text had reached, as the SDK makes it.
        arguments: Any = msgspec.Raw(block.call.arguments.encode())
        if not block.call.complete:
            partial = parse_partial(block.call.arguments)
            arguments = partial if isinstance(partial, dict) else {}
        return {
            "type": "tool_use",
            "id": _tool_use_id(block),
            "name": block.call.name,
            "input": arguments,
        }
    empty = EMPTY_BLOCKS[block.kind]
    return {**empty, DELTAS[block.kind][1]: block.text}


def _block_event(event: BlockEvent) -> bytes:
    block = event.block
    if event.kind == "start":
        if block.kind == "tool_call":
            assert block.call is not None
            start = {
                "type": "tool_use",
                "id": _tool_use_id(block),
                "name": block.call.name,
                "input": {},
            }
        else:
            start = EMPTY_BLOCKS[block.kind]
        return _event("content_block_start", index=block.index, content_block=start)
    if event.kind == "stop":
        return _event("content_block_stop", index=block.index)
    if block.kind == "tool_call":
        delta = {"type": "input_json_delta", "partial_json": event.delta}
    else:
        kind, field = DELTAS[block.kind]
        delta = {"type": kind, field: event.delta}
    return _event("content_block_delta", index=block.index, delta=delta)


def _event(kind: str, **fields: Any) -> bytes:
    body = _encode({"type": kind, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"


def _error(err: RequestError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(err.status), "message": err.message}}
