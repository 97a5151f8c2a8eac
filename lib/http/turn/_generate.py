"""Completions and chat completions: non-streaming, and streaming as server-sent events.

Each request runs in a cancel scope that a disconnect watcher (a task on ASGI `receive()`)
cancels when the client goes away: leaving `AsyncLLM.generate` then aborts the request in the
engine. A graceful shutdown gives in-flight requests `shutdown_timeout` seconds, then cancels
them too; their streams end with an error event and `[DONE]`.

Before a response starts, a request is checked whole (`_inputs`, the large parts off the
loop): its sampling values and token ids, its weight against the queue (prompts x n,
`_admission`), its prompts tokenised and length-checked, its constraint compiled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from ...engine.client import AsyncLLM, Output, PreparedRequest, TokenIds
from ..edge._admission import Held
from ..edge._errors import RequestError, error_body, http_error, internal_error
from ..edge._offload import Offload
from ..metrics._metrics import Metrics
from ..openai import _schemas as S
from ..openai._vllm_extras import Extras
from . import _tools_llama3 as L3
from ._chat_output import ChatOutputParser
from ._constraints import function_dicts, tool_choice_mode
from ._inputs import Inputs
from ._request_scope import RequestScope, RequestTiming, bind, run_all
from ._tools import DEFAULT_TOOL_PROMPT

log = logging.getLogger("trillm.http")
Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]
DRAINING_LAST_WRITE_S = 1.0  # a response's last writes once the server is shutting down
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
JSON = [(b"content-type", b"application/json")]


@dataclass(frozen=True)
class ChatPlan:
    """A chat request ready to run (`Generation.plan_chat`).

    Attributes:
        prepared: its one conversation, prepared (`AsyncLLM.prepare`).
        parser: makes a choice's parser when the request needs one (tools, a reasoning
            parser), else None: chat completions then sends the text as it is.
        turn_parser: makes a choice's parser always (the block-shaped APIs read every turn
            through one).
    """

    prepared: list[PreparedRequest]
    parser: Callable[[], ChatOutputParser] | None
    turn_parser: Callable[[], ChatOutputParser]


class Generation:
    """Runs generation requests for the app; counts them and drains them on shutdown."""

    def __init__(self, llm: AsyncLLM, config: Any, metrics: Metrics) -> None:
        self.llm = llm
        self.config = config
        self.metrics = metrics
        self.inflight = 0  # admitted generation requests (the app counts them)
        self.inputs = Inputs(llm, Offload(config.tokenizer_threads))
        self.draining = False
        self.scopes: set[trio.CancelScope] = set()

    def start_draining(self, timeout: float) -> None:
        """Refuse new requests; cancel the in-flight ones after `timeout` seconds."""
        self.draining = True
        for scope in self.scopes:
            scope.deadline = min(scope.deadline, trio.current_time() + timeout)
        self.drain_deadline = trio.current_time() + timeout

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
        rank, lora = request.data_parallel_rank, self.adapter_of(request.model)
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
        plan = await self.plan_chat(request, held)
        run = self._stream if request.stream else self._whole
        await run(plan.prepared, request, "chat", receive, send, extra, None, plan.parser)

    async def plan_chat(self, request: S.ChatCompletionRequest, held: Held) -> ChatPlan:
        """A chat request checked whole and ready to run: its prompt rendered and prepared,
        and the parser its choices need (reasoning, tool calls). The Responses and Messages
        APIs translate their requests into a chat request and run this same plan.

        Raises:
            RequestError: 400 naming the field (a bad tool choice, sampling value, prompt).
        """
        mode = tool_choice_mode(request.tools, request.tool_choice)
        if mode == "auto" and not self.config.enable_auto_tool_choice:
            raise RequestError(
                400,
                '"auto" tool choice (tools sent without a tool_choice, too) is off on this server '
                "(--no-enable-auto-tool-choice): send tool_choice 'required', 'none' or a named "
                "function, or run it with --enable-auto-tool-choice",
                param="tool_choice",
            )
        tool_format = self.config.tool_call_parser
        params, functions = await self.inputs.sampling_params(
            request, tool_format=tool_format, with_functions=mode != "none"
        )
        held.grow(params.n, what=f"1 conversation x n {params.n}", param="n")
        tool_prompt = L3.TOOL_PROMPT if tool_format == "llama3_json" else DEFAULT_TOOL_PROMPT
        variables = S.template_kwargs(request.chat_template_kwargs, request.reasoning_effort)
        prompt = await self.inputs.chat_prompt(
            request.messages,
            functions,
            tool_prompt,
            add_generation_prompt=request.add_generation_prompt is not False,
            continue_final_message=bool(request.continue_final_message),
            variables=variables,
        )
        rank, lora = request.data_parallel_rank, self.adapter_of(request.model)
        prepared = await self.inputs.prompts(
            [prompt], params, data_parallel_rank=rank, lora_name=lora
        )
        names = {f["name"] for f in functions} or None
        reasoning = self.llm.config.reasoning_parser  # the constraint's too: one setting
        parser = partial(
            ChatOutputParser, reasoning_parser=reasoning, tool_names=names, tool_format=tool_format
        )
        return ChatPlan(prepared, parser if names or reasoning else None, parser)

    async def chat_tokens(self, request: S.ChatCompletionRequest) -> list[int]:
        """The prompt `request` renders to, as token ids (its tools described as `plan_chat`
        describes them), without running it: Anthropic's count_tokens."""
        mode = tool_choice_mode(request.tools, request.tool_choice)
        functions = function_dicts(request.tools or []) if mode != "none" else []
        tool_format = self.config.tool_call_parser
        tool_prompt = L3.TOOL_PROMPT if tool_format == "llama3_json" else DEFAULT_TOOL_PROMPT
        variables = S.template_kwargs(request.chat_template_kwargs, request.reasoning_effort)
        return await self.inputs.chat_prompt(
            request.messages, functions, tool_prompt, variables=variables
        )

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
        async with self.running(receive) as scope:
            await run_all(
                [
                    bind(self._collect, prompt, results, i, started)
                    for i, prompt in enumerate(prompts)
                ]
            )
        if scope.cancelled_caught:
            if self.draining:
                raise RequestError(503, "the server is shutting down", "server_error")
            return  # the client went away: nobody to answer
        outputs = [o for per_prompt in results for o in per_prompt]
        if kind == "completion":
            body = S.completion_response(
                S.ResponseMeta.completion(self.model_name(request.model)),
                outputs,
                n=params.n,
                token_text=self._token_text(request),
                echo=echo,
                prompt_tokens_details=self.config.enable_prompt_tokens_details,
                extras=Extras.of(request, prompts),
            )
        else:
            body = S.chat_completion_response(
                S.ResponseMeta.chat(self.model_name(request.model)),
                outputs,
                n=params.n,
                token_text=self._token_text(request),
                parser=parser,
                prompt_tokens_details=self.config.enable_prompt_tokens_details,
                extras=Extras.of(request, prompts),
            )
        with trio.move_on_after(self.last_write_timeout()):
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
            self.observe(output, timing)
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
        model = self.model_name(request.model)
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
            async with self.running(receive) as scope:
                await run_all(
                    [
                        bind(self._stream_one, prompt, i * params.n, chunker, write, started)
                        for i, prompt in enumerate(prompts)
                    ]
                )
            if scope.cancelled_caught and self.draining:
                error = RequestError(503, "the server is shutting down", "server_error")
            elif scope.cancelled_caught:
                return  # the client went away
        except Exception as exc:  # as the whole response's status would be (`http_error`)
            error = http_error(exc)
            if error is None:
                log.exception("internal error in a stream")
                error = internal_error(exc)
        with trio.move_on_after(self.last_write_timeout()):
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
                        self.observe(output, timing)
                        finished += 1
        finally:  # a disconnect, a slow reader, a shutdown or an error ended the rest
            self.metrics.count_aborted(params.n - finished)

    # -- shared --------------------------------------------------------------------------

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model)."""
        return model if model is not None and model in self.llm.loras else None

    def model_name(self, model: str | None) -> str:
        """The `model` a response names: the adapter asked for, or the served model."""
        return self.adapter_of(model) or self.config.served_model_name

    def running(self, receive: Receive) -> RequestScope:
        return RequestScope(self, receive)

    def last_write_timeout(self) -> float:
        """Seconds for a response's last writes: short once draining, so a client that stopped
        reading cannot hold the shutdown past its deadline (its request is already over)."""
        timeout: float = self.config.write_timeout
        return min(timeout, DRAINING_LAST_WRITE_S) if self.draining else timeout

    def _token_text(self, request: Any) -> S.TokenText:
        """How the request's logprobs show tokens: their text (vLLM's, OpenAI's), or
        "token_id:N" with vLLM's `return_tokens_as_token_ids`."""
        pieces = self.llm.token_pieces
        return TokenIds(pieces) if request.return_tokens_as_token_ids else pieces

    def observe(self, output: Output, timing: RequestTiming) -> None:
        self.metrics.observe_request(
            ttft=timing.ttft,
            itl_list=timing.itl,
            e2e=time.monotonic() - timing.started,
            prompt_tokens=output.num_prompt_tokens,
            generation_tokens=output.num_output_tokens,
            finished_reason=output.finish_reason or "abort",
        )
