"""What `AsyncLLM` hands out and reads in: request streams, prompt-logprob outputs, tokenizers."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..protocol import _messages as P
from ._output_processor import RequestState
from ._outputs import Mailbox, Output, TokenLogprob


class RequestStream:
    """`async for output in stream`: a request's outputs, child by child, until all finish."""

    def __init__(self, mailbox: Mailbox, n: int) -> None:
        self._mailbox = mailbox
        self._unfinished = n
        self._buffer: list[Output] = []

    @property
    def finished(self) -> bool:
        return self._unfinished == 0 and not self._buffer

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Output:
        if not self._buffer:
            if self._unfinished == 0:
                raise StopAsyncIteration
            self._buffer = await self._mailbox.get()
        output = self._buffer.pop(0)
        if output.finished:
            self._unfinished -= 1
        return output


def prompt_logprobs_output(state: RequestState, event: P.Event) -> Output:
    """An output carrying one chunk of prompt logprobs (None for the first prompt token)."""
    logprobs = np.frombuffer(event.logprobs, "<f4").tolist()
    k = event.k
    top_ids = np.frombuffer(event.topk_ids, "<i4").reshape(-1, k).tolist() if k else None
    top_lps = np.frombuffer(event.topk_logprobs, "<f4").reshape(-1, k).tolist() if k else None
    first = event.first_position
    entries: list[TokenLogprob | None] = [None] if first == 1 else []
    for i, logprob in enumerate(logprobs):
        token = state.prompt_token_ids[first + i]
        top = list(zip(top_ids[i], top_lps[i], strict=True)) if top_ids and top_lps else []
        entries.append(TokenLogprob(token, logprob, top))
    return Output(
        state.index, "", [], num_prompt_tokens=state.num_prompt_tokens, prompt_logprobs=entries
    )


def load_tokenizer(path: str) -> Any:
    """The Hugging Face fast tokenizer of a model directory or GGUF file."""
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        directory, name = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return AutoTokenizer.from_pretrained(path)
