"""The frontend's input side without an event loop: prompts to checked token ids, chat
templates, and the per-child `RequestState` the output processor fills (DESIGN.md §1's
InputProcessor).

Nothing here waits, so the synchronous `LLM` and the trio `AsyncLLM` share it as is.

A text far longer than the model holds is tokenised by its head first: 4 MiB of text takes
seconds to tokenise whole (issue 25), while its first `(max_model_len + 8) * 8` characters
already have more tokens than fit whenever the text averages under 8 characters a token (any
natural text); only such a head is tokenised before the request is refused. A text denser
than that (runs of one character) is tokenised whole, as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from ...protocol import _messages as P
from .._errors import ChatTemplateError, InvalidPromptError, PromptTooLongError
from ..outputs._detokenizer import IncrementalDetokenizer, StopChecker
from ..outputs._output_processor import RequestState
from ..outputs._outputs import Mailbox
from ._prompt_embeds import PromptEmbeds, PromptEmbedsError
from ._sampling_params import SamplingParams

HEAD_CHARS_PER_TOKEN = 8  # a text longer than (max_model_len + margin) * this: head first
HEAD_MARGIN = 8  # tokens: what a cut through a word may add to the head's count


class InputProcessor:
    """Tokenises and checks prompts for one engine (its vocabulary and maximum length)."""

    def __init__(self, tokenizer: Any, ready: P.Ready, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.ready = ready
        self._backend = tokenizer.backend_tokenizer
        self._chat_template = chat_template  # a template's text, else the tokenizer's own

    def tokenize(
        self,
        prompt: str | Sequence[int],
        *,
        will_truncate: bool = False,
        add_special_tokens: bool = True,
    ) -> list[int]:
        """`prompt` as token ids (text is tokenised; ids are checked against the vocabulary).
        `will_truncate`: the caller keeps only the last tokens, so a text too long for the
        model is tokenised whole rather than refused by its head. `add_special_tokens`: the
        tokenizer's BOS/EOS around a text (vLLM's field of the same name).

        Raises:
            InvalidPromptError: an empty prompt or a token id outside the vocabulary.
            PromptTooLongError: the text's head alone has more tokens than the model holds
                (its `param` is "prompt"), unless `will_truncate`.
        """
        if isinstance(prompt, str):
            special = add_special_tokens
            if not will_truncate:
                self._refuse_if_head_too_long(prompt, add_special_tokens=special)
            ids: list[int] = self.tokenizer(prompt, add_special_tokens=special)["input_ids"]
        else:
            ids = list(prompt)
            vocab = self.ready.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidPromptError(
                    f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})"
                )
        if not ids:
            raise InvalidPromptError("the prompt is empty: send at least one token")
        return ids

    def pooling_ids(
        self,
        ids: list[int],
        truncate_prompt_tokens: int | None,
        param: str,
    ) -> list[int]:
        """A pooling prompt's ids (from `tokenize`, `will_truncate` when truncating) cut to
        their last `truncate_prompt_tokens` (vLLM's) and checked against the model's maximum
        length: a pooling request has no max_tokens to lower, only the input to cut.

        Raises:
            PromptTooLongError: more tokens than the model's maximum length (its `param` is
                `param`: "input" on the HTTP routes, "prompt" in `LLM.embed`).
        """
        if truncate_prompt_tokens is not None:
            ids = ids[-truncate_prompt_tokens:]
        limit = self.ready.max_model_len
        if len(ids) > limit:
            raise PromptTooLongError(
                f"the {param} has {len(ids)} tokens, more than the model's maximum length "
                f"{limit}: shorten it, or set truncate_prompt_tokens to cut it",
                param,
            )
        return ids

    def embeds_ids(self, embeds: PromptEmbeds, *, enabled: bool) -> list[int]:
        """Placeholder token ids (0), one per row of a prompt sent as embeddings, once the
        rows are checked against the model: its hidden size, its maximum length.

        Raises:
            PromptEmbedsError: the server does not take them (`enabled` false), or they do not
                fit the model.
        """
        if not enabled:
            raise PromptEmbedsError(
                "prompt_embeds is off on this server: start it with --enable-prompt-embeds "
                "(LLMConfig.enable_prompt_embeds), or send the prompt as text or token ids"
            )
        embeds.check(self.ready.hidden_size, self.ready.max_model_len)
        return [0] * embeds.num_tokens

    def prompt_ids(
        self, prompt: str | Sequence[int] | PromptEmbeds, params: SamplingParams, *, embeds: bool
    ) -> tuple[list[int], int]:
        """A generation prompt's token ids (placeholders for a `PromptEmbeds` one, taken
        only if `embeds`: `LLMConfig.enable_prompt_embeds`) and its request's max_tokens,
        each checked against the model (`AsyncLLM.prepare`'s).

        Raises:
            PromptEmbedsError, InvalidPromptError, PromptTooLongError: as `embeds_ids`,
                `tokenize` and `check_length`.
        """
        if isinstance(prompt, PromptEmbeds):
            ids = self.embeds_ids(prompt, enabled=embeds)
        else:
            ids = self.tokenize(prompt)
        return ids, self.check_length(len(ids), params)

    def check_length(self, num_prompt: int, params: SamplingParams) -> int:
        """The request's max_tokens, checked against the model's maximum length.

        Raises:
            PromptTooLongError: prompt + max_tokens exceed it (the message quotes both).
        """
        limit = self.ready.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - num_prompt
        if num_prompt + max_tokens > limit or max_tokens < 1:
            raise PromptTooLongError(
                f"the prompt has {num_prompt} tokens and max_tokens is {max_tokens}: together "
                f"{num_prompt + max_tokens}, more than the model's maximum length {limit}; "
                f"shorten the prompt or lower max_tokens"
            )
        return max_tokens

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat template over `messages`, ready for the assistant's reply (unless
        `add_generation_prompt` is false; `continue_final_message` leaves the final message
        open, as Hugging Face's template call does), as text; `tools` go to a template that
        reads them, `variables` (a request's chat_template_kwargs) are the template's to read.

        Raises:
            ChatTemplateError: the model has no chat template, or the template refused the
                messages (its `raise_exception`) or failed on them; the message quotes it.
        """
        if self._chat_template is None and not self.tokenizer.chat_template:
            raise ChatTemplateError(
                "the model has no chat template (no chat_template in its tokenizer_config.json, "
                "no chat_template.jinja): give one with --chat-template FILE "
                "(LLMConfig.chat_template), or send a plain prompt instead of messages"
            )
        try:
            text: str = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                chat_template=self._chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(variables or {}),
            )
        except Exception as exc:
            # The template is the model's code run on the caller's messages: whatever it
            # raises fails this request, never the server.
            raise _template_error(exc) from exc
        return text

    def chat_ids(self, text: str) -> list[int]:
        """A rendered chat's token ids (the template wrote its special tokens itself).

        Raises:
            PromptTooLongError: the text's head alone has more tokens than the model holds.
        """
        self._refuse_if_head_too_long(text, add_special_tokens=False)
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids

    def _refuse_if_head_too_long(self, text: str, *, add_special_tokens: bool) -> None:
        limit = self.ready.max_model_len
        cut = (limit + HEAD_MARGIN) * HEAD_CHARS_PER_TOKEN
        if len(text) <= cut:
            return
        head = self.tokenizer(text[:cut], add_special_tokens=add_special_tokens)["input_ids"]
        if len(head) > limit + HEAD_MARGIN:
            raise PromptTooLongError(
                f"the prompt has more than {len(head) - HEAD_MARGIN} tokens (its first {cut} "
                f"of {len(text)} characters alone), more than the model's maximum length "
                f"{limit}; shorten the prompt",
                param="prompt",
            )

    def new_state(
        self,
        rnum: int,
        mailbox: Mailbox,
        index: int,
        token_ids: list[int],
        params: SamplingParams,
        prompt_embeds: bytes = b"",
    ) -> RequestState:
        """The frontend's state of child `index` of a request, numbered `rnum`; a prompt of
        `prompt_embeds` has placeholder ids, which give the detokeniser no context."""
        stops = params.stop_strings
        return RequestState(
            rnum=rnum,
            index=index,
            mailbox=mailbox,
            detokenizer=IncrementalDetokenizer(
                self._backend,
                [] if prompt_embeds else token_ids,
                skip_special_tokens=params.skip_special_tokens,
            ),
            stop=StopChecker(stops, params.include_stop_str_in_output) if stops else None,
            num_prompt_tokens=len(token_ids),
            prompt_token_ids=token_ids,
            stop_token_ids=frozenset(params.stop_token_ids or ()),
            logprobs=params.logprobs,
            cache_salt=params.cache_salt or "",
            prompt_embeds=prompt_embeds,
        )

    def new_pooling_state(
        self, rnum: int, mailbox: Mailbox, token_ids: list[int], cache_salt: str = ""
    ) -> RequestState:
        """The frontend's state of a pooling request (embeddings), numbered `rnum`: its rows
        come back whole, so it has no detokeniser, no stop strings and no logprobs."""
        return RequestState(
            rnum=rnum,
            index=0,
            mailbox=mailbox,
            detokenizer=None,
            stop=None,
            num_prompt_tokens=len(token_ids),
            prompt_token_ids=token_ids,
            logprobs=None,
            cache_salt=cache_salt,
        )


def _template_error(exc: Exception) -> ChatTemplateError:
    """What the chat template raised, as the caller's error: its own words when it refused the
    messages, else the failure's kind and message."""
    if type(exc) is jinja2.TemplateError:  # exactly what the template's raise_exception raises
        return ChatTemplateError(f"the chat template refused the messages: {exc}")
    where = f" (line {exc.lineno})" if isinstance(exc, jinja2.TemplateSyntaxError) else ""
    return ChatTemplateError(
        f"the chat template could not render the messages: {type(exc).__name__}: {exc}{where}"
    )
