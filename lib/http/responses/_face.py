"""The Responses API's wire shape: a turn's blocks as output items, whole or as typed events.

A reasoning block is a `reasoning` item (its text a `reasoning_text` part), a text block a
`message` item with one `output_text` part, a tool call a `function_call` item. A stream is
OpenAI's event sequence, every event with its `sequence_number`: `response.created`,
`response.in_progress`; per item `response.output_item.added`, `response.content_part.added`,
the deltas (`response.output_text.delta`, `response.reasoning_text.delta`,
`response.function_call_arguments.delta`), their `.done`, `response.content_part.done`,
`response.output_item.done`; then `response.completed` (or `response.incomplete` when
`max_output_tokens` cut it, or `error` and `response.failed`). A finished response is stored
(`responses/_store`) when the request and the server keep it.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from ...engine.client import TokenLogprob
from ..edge._errors import RequestError
from ..openai._bodies import TokenText, chat_logprobs
from ..openai._requests import ChatMessage, MessageToolCall, ToolCallFunction
from ..turn._turn import Block, BlockEvent, TurnBlocks
from ._store import ResponseStore, StoredResponse

_encode = msgspec.json.Encoder().encode
ITEM_PREFIXES = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class ResponsesFace:
    """One response: its id, the request's settings it echoes, its items' ids."""

    def __init__(
        self,
        request: Any,
        config: Any,
        store: ResponseStore | None,
        messages: list[ChatMessage],
        token_text: TokenText | None = None,
    ) -> None:
        self.request = request
        self.token_text = token_text  # how logprobs name tokens, when the request asks
        self.model = config.served_model_name
        self.cached_details = config.enable_prompt_tokens_details
        self.store = store
        self.messages = messages  # the conversation before this turn (without instructions)
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self._sequence = 0
        self._item_ids: dict[int, str] = {}

    # -- whole ---------------------------------------------------------------------------

    def whole(self, turn: TurnBlocks) -> bytes:
        body = _encode(self._response(turn, self._status(turn)))
        self._keep(turn, body)
        return body

    def kept(self, turn: TurnBlocks, status: str, *, error: Any = None) -> bytes:
        """The response as it stands with `status` (a background run's), stored."""
        output: list[Any] | None = [] if status == "in_progress" else None
        response = self._response(turn, status, output=output)
        response["error"] = error
        body = _encode(response)
        self._keep(turn, body)
        return body

    # -- stream --------------------------------------------------------------------------

    def started(self, turn: TurnBlocks) -> bytes:
        response = self._response(turn, "in_progress", output=[])
        created = self._event("response.created", response=response)
        return created + self._event("response.in_progress", response=response)

    def events(self, turn: TurnBlocks, events: list[BlockEvent]) -> bytes:
        return b"".join(self._block_event(event) for event in events)

    def ended(self, turn: TurnBlocks) -> bytes:
        status = self._status(turn)
        response = self._response(turn, status)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
        data = self._event(kind.get(status, "response.failed"), response=response)
        self._keep(turn, _encode(response))
        return data

    def failed(self, turn: TurnBlocks, error: RequestError) -> bytes:
        code = "server_error" if error.status >= 500 else "invalid_prompt"
        data = self._event("error", code=code, message=error.message, param=error.param)
        response = self._response(turn, "failed")
        response["error"] = {"code": code, "message": error.message}
        return data + self._event("response.failed", response=response)

    # -- items and events ----------------------------------------------------------------

    def _block_event(self, event: BlockEvent) -> bytes:
        block, where = event.block, {"output_index": event.block.index}
        if event.kind == "start":
            item = self._item(block, "in_progress", empty=True)
            data = self._event("response.output_item.added", **where, item=item)
            if block.kind != "tool_call":
                part = self._part(block, empty=True)
                data += self._event(
                    "response.content_part.added", **self._at(block), content_index=0, part=part
                )
            return data
        if event.kind == "delta":
            if block.kind == "tool_call":
                name = "response.function_call_arguments.delta"
                return self._event(
                    name, item_id=self._item_ids[block.index], **where, delta=event.delta
                )
            if block.kind == "reasoning":
                return self._event(
                    "response.reasoning_text.delta",
                    **self._at(block),
                    content_index=0,
                    delta=event.delta,
                )
            return self._event(
                "response.output_text.delta",
                **self._at(block),
                content_index=0,
                delta=event.delta,
                logprobs=self._logprobs(event.logprobs),
            )
        # stop
        data = b""
        if block.kind == "tool_call":
            assert block.call is not None
            data += self._event(
                "response.function_call_arguments.done",
                **self._at(block),
                name=block.call.name,
                arguments=block.call.arguments,
            )
        else:
            if block.kind == "reasoning":
                data += self._event(
                    "response.reasoning_text.done",
                    **self._at(block),
                    content_index=0,
                    text=block.text,
                )
            else:
                data += self._event(
                    "response.output_text.done",
                    **self._at(block),
                    content_index=0,
                    text=block.text,
                    logprobs=self._logprobs(block.logprobs),
                )
            data += self._event(
                "response.content_part.done",
                **self._at(block),
                content_index=0,
                part=self._part(block),
            )
        item = self._item(block, _item_status(block))
        return data + self._event("response.output_item.done", **where, item=item)

    def _at(self, block: Block) -> dict[str, Any]:
        return {"item_id": self._item_ids[block.index], "output_index": block.index}

    def _item(self, block: Block, status: str, *, empty: bool = False) -> dict[str, Any]:
        item_id = self._item_ids.get(block.index)
        if item_id is None:
            item_id = self._item_ids[block.index] = _new_id(ITEM_PREFIXES[block.kind])
        if block.kind == "tool_call":
            assert block.call is not None
            return {
                "type": "function_call",
                "id": item_id,
                "call_id": block.call.id,
                "name": block.call.name,
                "arguments": "" if empty else block.call.arguments,
                "status": status,
            }
        parts = [] if empty else [self._part(block)]
        if block.kind == "reasoning":
            return {
                "type": "reasoning",
                "id": item_id,
                "summary": [],
                "content": parts,
                "encrypted_content": None,
                "status": status,
            }
        return {
            "type": "message",
            "id": item_id,
            "role": "assistant",
            "status": status,
            "content": parts,
        }

    def _part(self, block: Block, *, empty: bool = False) -> dict[str, Any]:
        text = "" if empty else block.text
        if block.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        logprobs = [] if empty else self._logprobs(block.logprobs)
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> list[Any]:
        """OpenAI's output_text logprobs: chat's (token, logprob, bytes, top_logprobs)."""
        if self.token_text is None or not logprobs:
            return []
        chat = chat_logprobs(logprobs, self.token_text)
        return msgspec.to_builtins(chat.content) if chat is not None else []

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(body) + b"\n\n"

    # -- the response --------------------------------------------------------------------

    def _status(self, turn: TurnBlocks) -> str:
        return {"stop": "completed", "length": "incomplete"}.get(turn.finish_reason or "", "failed")

    def _response(
        self, turn: TurnBlocks, status: str, *, output: list[Any] | None = None
    ) -> dict[str, Any]:
        r = self.request
        if output is None:
            output = [self._item(b, _item_status(b)) for b in turn.blocks]
        c = turn.counts
        # Prefix-cache hits (and so the tokens computed and written) tell a client what others
        # sent before: reported only with --enable-prompt-tokens-details, as chat's are.
        cached = c.cached_tokens if self.cached_details else 0
        written = c.prompt_tokens - c.cached_tokens if self.cached_details else 0
        usage = {
            "input_tokens": c.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
            "output_tokens": c.output_tokens,
            "output_tokens_details": {"reasoning_tokens": c.reasoning_tokens},
            "total_tokens": c.prompt_tokens + c.output_tokens,
        }
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        text = msgspec.to_builtins(r.text) if r.text is not None else {"format": {"type": "text"}}
        response = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": r.instructions,
            "metadata": r.metadata or {},
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "top_logprobs": r.top_logprobs if r.top_logprobs is not None else 0,
            "max_output_tokens": r.max_output_tokens,
            "previous_response_id": r.previous_response_id,
            "reasoning": msgspec.to_builtins(r.reasoning) if r.reasoning is not None else None,
            "text": text,
            "tool_choice": msgspec.to_builtins(r.tool_choice) if r.tool_choice else "auto",
            "tools": msgspec.to_builtins(r.tools or []),
            "truncation": r.truncation or "disabled",
            "store": self.store is not None,
            "background": bool(r.background),
            "service_tier": "default",
            "user": r.user,
            "safety_identifier": r.safety_identifier,
            "prompt_cache_key": r.prompt_cache_key,
            "usage": usage,
        }
        # OpenAI's schema has a string or no field, an object or no field.
        if r.user is None:
            del response["user"]
        if status == "in_progress":  # nothing counted yet
            del response["usage"]
        return response

    def _keep(self, turn: TurnBlocks, body: bytes) -> None:
        """Store the finished response, and its conversation for a `previous_response_id`."""
        if self.store is None:
            return
        reasoning = "".join(b.text for b in turn.blocks if b.kind == "reasoning") or None
        calls = [
            MessageToolCall(ToolCallFunction(b.call.name, b.call.arguments), b.call.id)
            for b in turn.blocks
            if b.call is not None
        ]
        reply = ChatMessage(
            "assistant", turn.text or None, tool_calls=calls or None, reasoning_content=reasoning
        )
        self.store.put(self.id, StoredResponse(body, (*self.messages, reply)))


def _item_status(block: Block) -> str:
    """An output item's final status: "incomplete" for the one the token limit cut off."""
    return "completed" if block.complete else "incomplete"
