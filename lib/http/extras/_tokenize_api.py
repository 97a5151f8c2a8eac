"""`POST /tokenize` and `/detokenize` (vLLM's): a prompt or chat to ids, ids to text; and
`GET /tokenizer_info` behind --enable-tokenizer-info-endpoint (vLLM's), the tokenizer's
configuration.

The POST routes count toward --max-queued-requests (1 each) and run on the tokenizer threads:
they hold a thread for as long as their input takes, and an unbounded input must not stall the
loop.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from ..edge._errors import RequestError
from ..edge._steps import Edge
from ..openai._schemas import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize_response,
    template_kwargs,
    tokenize_response,
    tokenizer_info_response,
)

Scope = dict[str, Any]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class TokenizeAPI:
    """The tokenizer routes of one app; `routes()` goes into its route table.

    Each is admitted `light` (`Edge.open`: weight 1 without the generation checks): a server
    that is draining or whose engine died can still tokenise."""

    def __init__(self, edge: Edge, generation: Any, *, info: bool = False) -> None:
        self.edge = edge
        self.generation = generation
        self.llm = generation.llm
        self.info = info  # serve GET /tokenizer_info

    def routes(self) -> dict[tuple[str, str], Callable[..., Awaitable[None]]]:
        routes: dict[tuple[str, str], Callable[..., Awaitable[None]]] = {
            ("POST", "/tokenize"): self.tokenize,
            ("POST", "/detokenize"): self.detokenize,
        }
        if self.info:
            routes[("GET", "/tokenizer_info")] = self.tokenizer_info
        return routes

    async def tokenize(self, scope: Scope, receive: Any, send: Send, extra: list[Any]) -> None:
        async with self.edge.open(scope, receive, TokenizeRequest, light=True) as (request, _):
            if request.messages is not None:  # a chat template carries its own special tokens
                tokens = await self.generation.inputs.chat_prompt(
                    request.messages,
                    add_generation_prompt=request.add_generation_prompt,
                    variables=template_kwargs(request.chat_template_kwargs),
                )
                if request.add_special_tokens:  # vLLM's: the tokenizer's on top of the template's
                    before, after = self._special_tokens
                    tokens = [*before, *tokens, *after]
            else:
                special = request.add_special_tokens is not False
                prompt = request.prompt or ""
                tokens = await self.generation.inputs.offload.run(
                    len(prompt), self._tokenized, prompt, special
                )
            strs = None
            if request.return_token_strs:
                convert = self.llm.tokenizer.convert_ids_to_tokens
                strs = await self.generation.inputs.offload.run(len(tokens), convert, tokens)
            answer = tokenize_response(
                tokens, max_model_len=self.llm.max_model_len, token_strs=strs
            )
        await self.edge.respond(send, 200, answer, extra)

    @functools.cached_property
    def _special_tokens(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer puts before and after a text (BOS, EOS), found by tokenising
        one text both ways: what `add_special_tokens` adds to a rendered template."""
        plain = self._tokenized("a", False)
        special = self._tokenized("a", True)
        for start in range(len(special) - len(plain) + 1):
            if special[start : start + len(plain)] == plain:
                return special[:start], special[start + len(plain) :]
        return [], []

    def _tokenized(self, prompt: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self.llm.tokenizer(prompt, add_special_tokens=add_special_tokens)[
            "input_ids"
        ]
        return ids

    async def detokenize(self, scope: Scope, receive: Any, send: Send, extra: list[Any]) -> None:
        async with self.edge.open(scope, receive, DetokenizeRequest, light=True) as (request, _):
            tokens = request.tokens
            text = await self.generation.inputs.offload.run(len(tokens), self._detokenized, tokens)
        await self.edge.respond(send, 200, detokenize_response(text), extra)

    async def tokenizer_info(
        self, scope: Scope, receive: Any, send: Send, extra: list[Any]
    ) -> None:
        info = tokenizer_info(self.llm.tokenizer, self.llm.chat_template)
        await self.edge.respond(send, 200, tokenizer_info_response(info), extra)

    def _detokenized(self, tokens: list[int]) -> str:
        vocab = self.llm.ready.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens"
            )
        text: str = self.llm.tokenizer.decode(tokens)
        return text


# The server's own file paths: a key holder learns nothing of its disk.
_PATH_FIELDS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


def tokenizer_info(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """vLLM's `TokenizerInfo`: the tokenizer's init arguments (special tokens as their text),
    less file paths, with its class and the chat template requests render with."""
    config = {k: _plain(v) for k, v in (tokenizer.init_kwargs or {}).items()}
    for name in _PATH_FIELDS:
        config.pop(name, None)
    config["tokenizer_class"] = type(tokenizer).__name__
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def _plain(value: Any) -> Any:
    """`value` as JSON can hold it: an added token as its text, keys as strings."""
    if hasattr(value, "content"):  # tokenizers' AddedToken
        return str(value.content)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)
