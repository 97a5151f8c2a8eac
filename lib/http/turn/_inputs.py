"""A generation request's inputs, checked whole before its response starts, the large ones
off the loop (`_offload`): sampling parameters (token ids against the vocabulary, a
constraint serialised), prompts tokenised and length-checked, the chat template rendered,
echoed prompts decoded.
"""

from __future__ import annotations

import base64
from functools import partial
from typing import Any

from ...engine.client import (
    AsyncLLM,
    PreparedRequest,
    PromptEmbeds,
    PromptEmbedsError,
    SamplingParams,
)
from ..edge._errors import RequestError
from ..edge._offload import INLINE_BELOW, Offload
from ..openai import _schemas as S
from ._constraints import function_dicts
from ._tools import DEFAULT_TOOL_PROMPT, chat_messages

Request = S.CompletionRequest | S.ChatCompletionRequest


class Inputs:
    """Turns requests into what `AsyncLLM.generate` takes, for one model."""

    def __init__(self, llm: AsyncLLM, offload: Offload) -> None:
        self.llm = llm
        self.offload = offload

    async def sampling_params(
        self, request: Request, *, tool_format: str = "hermes", with_functions: bool = False
    ) -> tuple[SamplingParams, list[dict[str, Any]]]:
        """The request's checked `SamplingParams`, and its tools as the dicts a template
        reads when `with_functions` (else none).

        Raises:
            RequestError: 400 naming the field (`to_sampling_params`).
        """
        vocab = self.llm.ready.vocab_size

        def convert() -> tuple[SamplingParams, list[dict[str, Any]]]:
            params = S.to_sampling_params(request, tool_format=tool_format, vocab_size=vocab)
            tools = getattr(request, "tools", None) or []
            return params, function_dicts(tools) if with_functions else []

        return await self.offload.run(_constraint_size(request), convert)

    async def completion_prompts(
        self, request: S.CompletionRequest
    ) -> list[str | list[int] | PromptEmbeds]:
        """A completions request's prompts: texts or token-id lists, or its `prompt_embeds`
        decoded (base64, then safetensors: never a pickle) and checked finite.

        Raises:
            RequestError: 400: `echo` with prompt embeddings (they have no text).
            PromptEmbedsError: (400 naming prompt_embeds) the server does not take them, or
                one is not base64 of a safetensors file of one float tensor [tokens, hidden].
        """
        if request.prompt_embeds is None:
            return list(request.prompts)
        if not self.llm.config.enable_prompt_embeds:
            raise PromptEmbedsError(
                "prompt_embeds is off on this server: start it with --enable-prompt-embeds, or "
                "send the prompt as text or token ids"
            )
        if request.echo:
            raise RequestError(
                400,
                "echo cannot show a prompt sent as prompt_embeds: it has no text",
                param="echo",
            )
        texts = request.prompt_embeds
        texts = [texts] if isinstance(texts, str) else texts
        return [await self.offload.run(len(t), partial(decode_prompt_embeds, t)) for t in texts]

    async def prompts(
        self,
        prompts: list[str | list[int] | PromptEmbeds],
        params: SamplingParams,
        *,
        data_parallel_rank: int | None = None,
        lora_name: str | None = None,
    ) -> list[PreparedRequest]:
        """Every prompt checked whole now (`AsyncLLM.prepare`: tokenised, length-checked, its
        constraint compiled), so a bad one is a 400, not a broken stream (the response has
        not started yet); what `generate` then sends without checking again, to the engine
        `data_parallel_rank` when given, with LoRA adapter `lora_name` (None: the base).

        Raises:
            InvalidPromptError, PromptTooLongError, StructuredOutputError: (400s, by
                `_errors.http_error`) an empty prompt, an id outside the vocabulary, a prompt
                longer than the model holds, a bad constraint.
        """
        prepared, rank = [], data_parallel_rank
        for prompt in prompts:
            # (checking embeddings is cheap: what is large was done decoding them)
            size = 0 if isinstance(prompt, PromptEmbeds) else len(prompt)
            run = partial(self.offload.run, size)
            checked = await self.llm.prepare(
                prompt, params, run=run, data_parallel_rank=rank, lora_name=lora_name
            )
            prepared.append(checked)
        return prepared

    async def chat_prompt(
        self,
        messages: list[S.ChatMessage],
        functions: list[dict[str, Any]] | None = None,
        tool_prompt: str = DEFAULT_TOOL_PROMPT,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: dict[str, Any] | None = None,
    ) -> list[int]:
        """The chat template over `messages` (and `functions`), as token ids; `variables`
        (chat_template_kwargs, a reasoning effort) are the template's to read;
        `continue_final_message` leaves the final message open (vLLM's and Hugging Face's).

        Raises:
            RequestError: 400: more messages than the model has positions (each message
                takes at least one token, whatever the template).
            ChatTemplateError: the template refused the messages or failed on them.
        """
        limit = self.llm.max_model_len
        if len(messages) > limit:
            raise RequestError(
                400,
                f"{len(messages)} messages cannot fit in the model's maximum length of {limit} "
                f"tokens (each takes at least one); send fewer",
                param="messages",
            )
        functions = functions or []
        reads_tools = self.llm.template_reads_tools

        def render() -> list[int]:
            rendered, tools = chat_messages(
                S.chat_template_messages(messages), functions, reads_tools, tool_prompt
            )
            ids: list[int] = self.llm.apply_chat_template(
                rendered,
                tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                variables=variables,
            )
            return ids

        return await self.offload.run(_chat_size(messages, functions), render)

    async def echo(self, prompts: list[PreparedRequest], request: Any) -> list[S.EchoPrompt] | None:
        """The prompts as `echo` shows them (None unless the request asks for it)."""
        if not getattr(request, "echo", False):
            return None
        tokenizer = self.llm.tokenizer

        def echoes() -> list[S.EchoPrompt]:
            return [S.EchoPrompt(tokenizer.decode(p.token_ids), p.token_ids) for p in prompts]

        return await self.offload.run(sum(len(p.token_ids) for p in prompts), echoes)


def decode_prompt_embeds(text: str) -> PromptEmbeds:
    """One `prompt_embeds` entry: base64 of a safetensors file of one float tensor.

    Raises:
        PromptEmbedsError: not base64, or as `PromptEmbeds.from_safetensors`.
    """
    try:
        blob = base64.b64decode(text, validate=True)
    except ValueError as exc:  # binascii.Error is one; so is a non-ASCII character
        raise PromptEmbedsError(
            f"prompt_embeds must be base64 (of a safetensors file): {exc}"
        ) from None
    return PromptEmbeds.from_safetensors(blob)


def _constraint_size(request: Request) -> int:
    """The work of mapping a request's fields to `SamplingParams`, in the offload's units: a
    constraint (tools, a schema) is serialised, which may be megabytes."""
    tools = getattr(request, "tools", None)
    if tools or request.structured_outputs is not None or request.response_format is not None:
        return INLINE_BELOW
    return 0


def _chat_size(messages: list[S.ChatMessage], functions: list[dict[str, Any]]) -> int:
    """The work of rendering a conversation, in the offload's units: a short one with no
    tools stays on the loop (a 2-message template takes about 30-55 µs)."""
    if len(messages) > 8 or functions:
        return INLINE_BELOW
    return sum(len(m.text) + 64 for m in messages)
