"""Streaming: the chunks of one response, built from its outputs as they come."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from ...engine.client import Output, TokenLogprob
from ..turn._chat_output import ChatOutputParser
from ._bodies import EchoPrompt, ResponseMeta, TokenText, Usage, usage_of
from ._chat_bodies import chat_completion_chunk, chat_usage_chunk, tool_calls_finish
from ._completion_bodies import completion_chunk, completion_usage_chunk
from ._vllm_extras import Extras, chunk_usage


class StreamChunker:
    """The chunks of one streamed response, from its outputs as they come.

    It holds what OpenAI's stream shape needs across chunks: whether a choice has started
    (chat's role chunk, completions' echo), each choice's text offset (logprobs), and the
    token counts for the final usage chunk. An echoed prompt waits for the choice's first
    token, so that all of the prompt's logprobs (which arrive in pieces, one per prefill
    chunk) are in its first chunk. vLLM's `extras`: token ids a chunk did not show (text
    held back) go with the next one; chat's echo is the role chunk's content.
    """

    def __init__(
        self,
        meta: ResponseMeta,
        *,
        chat: bool,
        n: int,
        token_text: TokenText,
        include_usage: bool = False,
        echo: Sequence[EchoPrompt] | None = None,
        parser: Callable[[], ChatOutputParser] | None = None,
        prompt_tokens_details: bool = False,
        extras: Extras | None = None,
    ) -> None:
        self.meta, self.chat, self.n = meta, chat, n
        self.prompt_tokens_details = prompt_tokens_details  # report cached_tokens
        self._parser = parser  # chat: reasoning / tool calls, one parser per choice
        self._parsers: dict[int, ChatOutputParser] = {}
        self.token_text = token_text
        self.include_usage = include_usage
        self.echo = echo
        self._offsets: dict[int, int] = {}  # choice -> text streamed so far (started choices)
        self._held: dict[int, list[TokenLogprob | None]] = {}  # echo: prompt logprobs so far
        self._last: dict[int, Output] = {}  # choice -> a summary of its counts
        self.extras = extras or Extras()
        self._unsent_ids: dict[int, list[int]] = {}  # return_token_ids: not in a chunk yet

    def chunks(self, output: Output) -> list[bytes]:
        """The chunks to send for `output`, in order; often one.

        None if it has nothing to show (no text, no logprobs, not the end) or while an echo
        waits for the first token; a chat choice's first output gets a role chunk before.
        """
        self._count(output)
        index, started = output.index, output.index in self._offsets
        ids = self._unsent_ids.pop(index, []) + output.token_ids
        if not (output.text or output.logprobs or output.finished):
            if self.echo and not started and output.prompt_logprobs:
                self._held.setdefault(index, []).extend(output.prompt_logprobs)
            self._unsent_ids[index] = ids
            return []
        extras = self.extras
        token_ids = ids if extras.return_token_ids else None
        usage_so_far = chunk_usage(self._last.get(index)) if extras.continuous_usage else None
        prompt_ids = None
        if extras.return_token_ids and not started:
            prompt_ids = list(extras.prompt_token_ids[index // self.n])
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(output.text)
        usage, text_of = self.include_usage, self.token_text
        if self.chat:
            parts, finish = None, None
            if self._parser is not None:
                if index not in self._parsers:
                    self._parsers[index] = self._parser()
                parser = self._parsers[index]
                parts = parser.feed(output.text)
                if output.finished:
                    parts.add(parser.finish(cut=output.finish_reason == "length"))
                    finish = tool_calls_finish(output.finish_reason, bool(parser.tool_calls))
                elif not (parts.content or parts.reasoning or parts.tool_calls or output.logprobs):
                    if not started:  # the role chunk still comes first, with the first text
                        del self._offsets[index]
                    self._unsent_ids[index] = ids
                    return []  # all held back (a tag may be starting)
            chunk = chat_completion_chunk(
                self.meta,
                output,
                token_text=text_of,
                include_usage=usage,
                parts=parts,
                finish_reason=finish,
                token_ids=token_ids,
                usage=usage_so_far,
            )
            if started:
                return [chunk]
            role = chat_completion_chunk(
                self.meta,
                Output(index, extras.echo, []),
                token_text=text_of,
                first=True,
                include_usage=usage,
                prompt_token_ids=prompt_ids,
                usage=usage_so_far,
            )
            return [role, chunk]
        echo = None if started or not self.echo else self.echo[index // self.n]
        if echo is not None:
            self._offsets[index] += len(echo.text)
            held = self._held.pop(index, [])
            if held:
                output = dataclasses.replace(
                    output, prompt_logprobs=held + (output.prompt_logprobs or [])
                )
        chunk = completion_chunk(
            self.meta,
            output,
            token_text=text_of,
            text_offset=offset,
            echo=echo,
            include_usage=usage,
            token_ids=token_ids,
            prompt_token_ids=prompt_ids,
            usage=usage_so_far,
        )
        return [chunk]

    def usage(self) -> Usage:
        """The usage of everything streamed so far."""
        return usage_of(
            self._last.values(), n=self.n, prompt_tokens_details=self.prompt_tokens_details
        )

    def usage_chunk(self) -> bytes:
        """The last chunk when the request set `stream_options.include_usage`."""
        if self.chat:
            return chat_usage_chunk(self.meta, self.usage())
        return completion_usage_chunk(self.meta, self.usage())

    def _count(self, output: Output) -> None:
        last = self._last.get(output.index)
        if last is None:
            self._last[output.index] = Output(
                output.index,
                "",
                [],
                None,
                None,
                None,
                output.num_prompt_tokens,
                output.num_output_tokens,
                output.num_cached_tokens,
            )
            return
        # Counts are cumulative, but an output that carried only prompt logprobs has zeros.
        last.num_prompt_tokens = max(last.num_prompt_tokens, output.num_prompt_tokens)
        last.num_output_tokens = max(last.num_output_tokens, output.num_output_tokens)
        last.num_cached_tokens = max(last.num_cached_tokens, output.num_cached_tokens)
