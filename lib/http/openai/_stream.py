"""Completions and chat completions: non-streaming, and streaming as server-sent events.

Each request runs in a cancel scope that a disconnect watcher (a task on ASGI `receive()`)
cancels when the client goes away: leaving `AsyncLLM.generate` then aborts the request in the
engine. A graceful shutdown gives in-flight requests `shutdown_timeout` seconds, then cancels
them too; their streams end with an error event and `[DONE]`. The face-neutral part (the chat
plan, the request scope, the drain) is `turn/_generate.Generation`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ...engine.client import Output, PreparedRequest, TokenIds
from ..edge._admission import Held
from ..edge._errors import RequestError, error_body, http_error, internal_error
from ..edge._steps import Receive, Send
from ..turn._chat_output import ChatOutputParser
from ..turn._generate import JSON, SSE_HEADERS, Generation
from ..turn._request_scope import RequestTiming, bind, run_all
from . import _schemas as S
from ._vllm_extras import Extras

log = logging.getLogger("trillm.http")


class CompletionRunner:
    """Runs completions and chat completions over the app's `Generation`, whole or streamed."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.llm = generation.llm
        self.config = generation.config
        self.metrics = generation.metrics
        self.inputs = generation.inputs

    # -- entry points ----------------------------------------------------------------------

    async def completions(
        self,
        request: S.CompletionRequest,
        receive: Receive,
        send: Send,
        extra: list[Any],
        held: Held,
    ) -> None:
        params, _ = await self.inputs.sampling_params(request)
        prompts = await self.inputs.completion_prompts(request)
        held.grow(len(prompts) * params.n, what=f"{len(prompts)} prompts x n {params.n}")
        rank, lora = request.data_parallel_rank, self.generation.adapter_of(request.model)
        prepared = await self.inputs.prompts(
            prompts, params, data_parallel_rank=rank, lora_name=lora
        )
        echo = await self.inputs.echo(prepared, request)
        run = self._stream if request.stream else self._whole
        await run(prepared, request, "completion", receive, send, extra, echo)

    async def chat(
        self,
        request: S.ChatCompletionRequest,
        receive: Receive,
        send: Send,
        extra: list[Any],
        held: Held,
    ) -> None:
        plan = await self.generation.plan_chat(request, held)
        run = self._stream if request.stream else self._whole
        await run(plan.prepared, request, "chat", receive, send, extra, None, plan.parser)

    # -- non-streaming -------------------------------------------------------------------

    async def _whole(
        self,
        prompts: list[PreparedRequest],
        request: Any,
        kind: str,
        receive: Receive,
        send: Send,
        extra: list[Any],
        echo: list[S.EchoPrompt] | None = None,
        parser: Callable[[], ChatOutputParser] | None = None,
    ) -> None:
        params = prompts[0].params
        results: list[list[Output]] = [[] for _ in prompts]
        started = time.monotonic()
        async with self.generation.running(receive) as scope:
            await run_all(
                [
                    bind(self._collect, prompt, results, i, started)
                    for i, prompt in enumerate(prompts)
                ]
            )
        if scope.cancelled_caught:
            if self.generation.draining:
                raise RequestError(503, "the server is shutting down", "server_error")
            return  # the client went away: nobody to answer
        outputs = [o for per_prompt in results for o in per_prompt]
        if kind == "completion":
            body = S.completion_response(
                S.ResponseMeta.completion(self.generation.model_name(request.model)),
                outputs,
                n=params.n,
                token_text=self._token_text(request),
                echo=echo,
                prompt_tokens_details=self.config.enable_prompt_tokens_details,
                extras=Extras.of(request, prompts),
            )
        else:
            body = S.chat_completion_response(
                S.ResponseMeta.chat(self.generation.model_name(request.model)),
                outputs,
                n=params.n,
                token_text=self._token_text(request),
                parser=parser,
                prompt_tokens_details=self.config.enable_prompt_tokens_details,
                extras=Extras.of(request, prompts),
            )
        with trio.move_on_after(self.generation.last_write_timeout()):
            await send({"type": "http.response.start", "status": 200, "headers": JSON + extra})
            await send({"type": "http.response.body", "body": body})

    async def _collect(
        self, prompt: PreparedRequest, results: list[list[Output]], index: int, started: float
    ) -> None:
        merged: dict[int, Output] = {}
        timing = RequestTiming(started)
        async with self.llm.generate(prompt) as stream:
            async for output in stream:
                timing.saw(output)
                if output.index in merged:
                    merged[output.index].merge(output)
                else:
                    merged[output.index] = output
        outputs = [merged[i] for i in sorted(merged)]
        base = index * prompt.params.n
        for output in outputs:
            output.index += base
            self.generation.observe(output, timing)
        results[index] = outputs

    # -- streaming -----------------------------------------------------------------------

    async def _stream(
        self,
        prompts: list[PreparedRequest],
        request: Any,
        kind: str,
        receive: Receive,
        send: Send,
        extra: list[Any],
        echo: list[S.EchoPrompt] | None = None,
        parser: Callable[[], ChatOutputParser] | None = None,
    ) -> None:
        model = self.generation.model_name(request.model)
        params = prompts[0].params
        chunker = S.StreamChunker(
            S.ResponseMeta.completion(model)
            if kind == "completion"
            else S.ResponseMeta.chat(model),
            chat=kind == "chat",
            n=params.n,
            token_text=self._token_text(request),
            include_usage=request.include_usage,
            echo=echo,
            parser=parser,
            prompt_tokens_details=self.config.enable_prompt_tokens_details,
            extras=Extras.of(request, prompts),
        )
        lock = trio.Lock()
        started = time.monotonic()

        # No timeout here: the connection bounds its own writes (`_connections.BoundedStream`,
        # `--write-timeout`); a client cut off for not reading is seen as a disconnect.
        async def write(data: bytes) -> None:
            async with lock:
                await send({"type": "http.response.body", "body": data, "more_body": True})

        # The validation is done: from here on every failure is an event in the stream.
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + extra})
        error: RequestError | None = None
        try:
            async with self.generation.running(receive) as scope:
                await run_all(
                    [
                        bind(self._stream_one, prompt, i * params.n, chunker, write, started)
                        for i, prompt in enumerate(prompts)
                    ]
                )
            if scope.cancelled_caught and self.generation.draining:
                error = RequestError(503, "the server is shutting down", "server_error")
            elif scope.cancelled_caught:
                return  # the client went away
        except Exception as exc:  # as the whole response's status would be (`http_error`)
            error = http_error(exc)
            if error is None:
                log.exception("internal error in a stream")
                error = internal_error(exc)
        with trio.move_on_after(self.generation.last_write_timeout()):
            if error is not None:
                await write(S.sse(error_body(error)))
            elif request.include_usage:
                await write(S.sse(chunker.usage_chunk()))
            await send({"type": "http.response.body", "body": S.SSE_DONE, "more_body": False})

    async def _stream_one(
        self,
        prompt: PreparedRequest,
        base: int,
        chunker: S.StreamChunker,
        write: Callable[[bytes], Awaitable[None]],
        started: float,
    ) -> None:
        interval = self.config.stream_interval
        params = prompt.params
        timing = RequestTiming(started)
        pending: dict[int, Output] = {}  # held until `stream_interval` tokens (or the end)
        finished = 0
        try:
            async with self.llm.generate(prompt) as stream:
                async for output in stream:
                    timing.saw(output)
                    output.index += base
                    held = pending.get(output.index)
                    if held is not None:
                        held.merge(output)
                        output = held
                    if len(output.token_ids) < interval and not output.finished:
                        pending[output.index] = output
                        continue
                    pending.pop(output.index, None)
                    for data in chunker.chunks(output):
                        await write(S.sse(data))
                    if output.finished:
                        self.generation.observe(output, timing)
                        finished += 1
        finally:  # a disconnect, a slow reader, a shutdown or an error ended the rest
            self.metrics.count_aborted(params.n - finished)

    def _token_text(self, request: Any) -> S.TokenText:
        """How the request's logprobs show tokens: their text (vLLM's, OpenAI's), or
        "token_id:N" with vLLM's `return_tokens_as_token_ids`."""
        pieces = self.llm.token_pieces
        return TokenIds(pieces) if request.return_tokens_as_token_ids else pieces
