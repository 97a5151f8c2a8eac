"""`POST /tokenize` and `/detokenize` (vLLM's): a prompt or chat to ids, ids to text.

Both count toward --max-queued-requests (1 each) and run on the tokenizer threads: they hold
a thread for as long as their input takes, and an unbounded input must not stall the loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ._errors import RequestError
from ._pooling_api import Edge
from ._schemas import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize_response,
    template_kwargs,
    tokenize_response,
)

Scope = dict[str, Any]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class TokenizeAPI:
    """The tokenizer routes of one app; `routes()` goes into its route table.

    `hold` admits at weight 1 without the generation checks (`Admission.hold`): a server
    that is draining or whose engine died can still tokenise."""

    def __init__(self, edge: Edge, generation: Any, hold: Callable[[], Any]) -> None:
        self.edge = edge
        self.generation = generation
        self.llm = generation.llm
        self.hold = hold

    def routes(self) -> dict[tuple[str, str], Callable[..., Awaitable[None]]]:
        return {("POST", "/tokenize"): self.tokenize, ("POST", "/detokenize"): self.detokenize}

    async def tokenize(self, scope: Scope, receive: Any, send: Send, extra: list[Any]) -> None:
        body = await self.edge.read_body(scope, receive)
        with self.hold():
            request = await self.edge.decode(body, TokenizeRequest)
            if request.messages is not None:  # a chat template carries its own special tokens
                tokens = await self.generation.inputs.chat_prompt(
                    request.messages,
                    add_generation_prompt=request.add_generation_prompt,
                    variables=template_kwargs(request.chat_template_kwargs),
                )
            else:
                special = request.add_special_tokens is not False
                prompt = request.prompt or ""
                tokens = await self.generation.inputs.offload.run(
                    len(prompt), self._tokenized, prompt, special
                )
            answer = tokenize_response(tokens, max_model_len=self.llm.max_model_len)
        await self.edge.respond(send, 200, answer, extra)

    def _tokenized(self, prompt: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self.llm.tokenizer(prompt, add_special_tokens=add_special_tokens)[
            "input_ids"
        ]
        return ids

    async def detokenize(self, scope: Scope, receive: Any, send: Send, extra: list[Any]) -> None:
        body = await self.edge.read_body(scope, receive)
        with self.hold():
            request = await self.edge.decode(body, DetokenizeRequest)
            tokens = request.tokens
            text = await self.generation.inputs.offload.run(len(tokens), self._detokenized, tokens)
        await self.edge.respond(send, 200, detokenize_response(text), extra)

    def _detokenized(self, tokens: list[int]) -> str:
        vocab = self.llm.ready.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens"
            )
        text: str = self.llm.tokenizer.decode(tokens)
        return text
