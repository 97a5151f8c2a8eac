"""What `AsyncLLM` hands out: request streams, and a pooling request's result
(`prompt_logprobs_output` lives in `_output_processor`, with the rest of the per-record
work; re-exported here)."""

from __future__ import annotations

from .._errors import RequestFailedError
from ._output_processor import prompt_logprobs_output as prompt_logprobs_output
from ._outputs import Mailbox, Output
from ._pooling import PoolingOutput


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


async def wait_pooled(mailbox: Mailbox, num_prompt_tokens: int) -> PoolingOutput:
    """A pooling request's result, from its mailbox once it finished (`AsyncLLM.encode`).

    Raises:
        RequestFailedError: it finished without a result (the reason says how).
    """
    while True:
        for output in await mailbox.get():
            if not output.finished:
                continue
            if output.pooled is None:
                raise RequestFailedError(
                    f"the pooling request ended ({output.finish_reason}) without a result"
                )
            return PoolingOutput(output.pooled, num_prompt_tokens, output.num_cached_tokens)
