"""`POST /v1/chat/completions/batch` (vLLM's): N conversations in one request, a choice each.

The body is a chat completion's whose `messages` is a list of conversations. Each
conversation runs as a chat completion of its own through the chat route, concurrently, so
every other field means there what it means in a chat completion, and is refused where it is
refused there; the answer is one chat completion whose choice i is conversation i's, with
their usage summed. As vLLM's: no streaming, no tools, one choice a conversation (`n` 1);
a conversation that fails fails the batch with its error, and the others are cancelled.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

from ..edge._errors import RequestError
from ._invocations import replayed

Scope = dict[str, Any]
Handler = Callable[[Scope, Any, Any, list[Any]], Awaitable[None]]

_fields = msgspec.json.Decoder(dict[str, msgspec.Raw])
_conversations = msgspec.json.Decoder(list[msgspec.Raw])
_REFUSED = {  # field -> why a batch cannot take it (vLLM's batch refuses the same)
    "stream": "stream the conversations one request each",
    "tools": "send conversations with tools one request each",
    "n": "a batch answers one choice a conversation",
    "use_beam_search": "beam search is not supported",
    "prompt_logprobs": "send conversations that need prompt_logprobs one request each",
}
_UNSET = (b"null", b"false", b"1")


class ChatBatch:
    """The batch route over the app's chat route (`chat`); `read_body` and `respond` are the
    app's."""

    def __init__(
        self,
        chat: Handler,
        read_body: Callable[[Scope, Any], Awaitable[bytes]],
        respond: Callable[[Any, int, bytes, list[Any]], Awaitable[None]],
        *,
        max_conversations: int,
    ) -> None:
        self.chat, self.read_body, self.respond = chat, read_body, respond
        self.max_conversations = max_conversations

    async def handle(self, scope: Scope, receive: Any, send: Any, extra: list[Any]) -> None:
        bodies = self.split(await self.read_body(scope, receive))
        results: list[tuple[int, bytes] | BaseException | None] = [None] * len(bodies)
        gone = trio.Event()  # the client hung up: every conversation sees it
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, gone)
            async with trio.open_nursery() as runs:
                for i, body in enumerate(bodies):
                    runs.start_soon(self._one, scope, body, gone, extra, results, i, runs)
            nursery.cancel_scope.cancel()
        answers = []
        for result in results:
            if isinstance(result, BaseException):
                raise result
            if result is None:  # cancelled by another's failure: that one is raised first
                continue
            status, body = result
            if status != 200:
                await self.respond(send, status, body, extra)
                return
            answers.append(body)
        await self.respond(send, 200, merge(answers), extra)

    def split(self, body: bytes) -> list[bytes]:
        """One chat completion body per conversation.

        Raises:
            RequestError: 400: not a JSON object, `messages` not a non-empty list of
                conversations (at most `max_conversations`), or a field a batch refuses.
        """
        try:
            fields = _fields.decode(body)
            conversations = _conversations.decode(fields.get("messages", msgspec.Raw(b"0")))
        except msgspec.DecodeError:
            raise RequestError(
                400,
                "a chat completions batch is a JSON object whose messages is a list of "
                "conversations (each a list of messages)",
                param="messages",
            ) from None
        if not conversations or len(conversations) > self.max_conversations:
            raise RequestError(
                400,
                f"messages must hold 1 to {self.max_conversations} conversations "
                f"(--max-prompts-per-request), got {len(conversations)}",
                param="messages",
            )
        if any(not bytes(c).lstrip().startswith(b"[") for c in conversations):
            raise RequestError(
                400, "each conversation of messages must be a list of messages", param="messages"
            )
        for name, why in _REFUSED.items():
            value = fields.get(name)
            if value is not None and bytes(value).strip() not in _UNSET:
                raise RequestError(400, f"{name} is not served in a batch: {why}", param=name)
        return [msgspec.json.encode(fields | {"messages": c}) for c in conversations]

    async def _one(
        self,
        scope: Scope,
        body: bytes,
        gone: trio.Event,
        extra: list[Any],
        results: list[tuple[int, bytes] | BaseException | None],
        i: int,
        runs: trio.Nursery,
    ) -> None:
        status, chunks = 500, []

        async def disconnected() -> dict[str, Any]:
            await gone.wait()
            return {"type": "http.disconnect"}

        receive = replayed(body, disconnected)

        async def capture(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        try:
            await self.chat(scope, receive, capture, extra)
        except Exception as exc:  # the batch's answer: the first failure, by index
            results[i] = exc
            runs.cancel_scope.cancel()
            return
        results[i] = (status, b"".join(chunks))
        if status != 200:
            runs.cancel_scope.cancel()


async def _watch_disconnect(receive: Any, gone: trio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


def merge(bodies: list[bytes]) -> bytes:
    """One chat completion from each conversation's: choice i is conversation i's, the usage
    their sum; the id, created and model are the first's."""
    answers = [msgspec.json.decode(b) for b in bodies]
    merged = answers[0]
    merged["choices"] = [a["choices"][0] | {"index": i} for i, a in enumerate(answers)]
    first = answers[0]["usage"]
    usage = {k: sum(a["usage"][k] for a in answers) for k, v in first.items() if type(v) is int}
    if "prompt_tokens_details" in answers[0]["usage"]:
        cached = sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    merged["usage"] = usage
    return msgspec.json.encode(merged)
