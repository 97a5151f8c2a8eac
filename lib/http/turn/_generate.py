"""The generation service every face runs (`Generation`): plan a chat turn, count, drain.

Chat completions (`openai/_stream`), Responses and Messages (`_turn_runner`) plan their chat
request here and run it in a cancel scope that a disconnect watcher (a task on ASGI
`receive()`) cancels when the client goes away: leaving `AsyncLLM.generate` then aborts the
request in the engine. A graceful shutdown gives in-flight requests `shutdown_timeout`
seconds, then cancels them too.

Before a response starts, a request is checked whole (`_inputs`, the large parts off the
loop): its sampling values and token ids, its weight against the queue (prompts x n,
`_admission`), its prompts tokenised and length-checked, its constraint compiled.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from ...engine.client import AsyncLLM, Output, PreparedRequest
from ..edge._admission import Held
from ..edge._errors import RequestError
from ..edge._offload import Offload
from ..metrics._metrics import Metrics
from ..openai._requests import ChatCompletionRequest, template_kwargs
from . import _tools_llama3 as L3
from ._chat_output import ChatOutputParser
from ._constraints import function_dicts, tool_choice_mode
from ._inputs import Inputs
from ._request_scope import RequestScope, RequestTiming
from ._tools import DEFAULT_TOOL_PROMPT

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

    async def plan_chat(self, request: ChatCompletionRequest, held: Held) -> ChatPlan:
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
        variables = template_kwargs(request.chat_template_kwargs, request.reasoning_effort)
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

    async def chat_tokens(self, request: ChatCompletionRequest) -> list[int]:
        """The prompt `request` renders to, as token ids (its tools described as `plan_chat`
        describes them), without running it: Anthropic's count_tokens."""
        mode = tool_choice_mode(request.tools, request.tool_choice)
        functions = function_dicts(request.tools or []) if mode != "none" else []
        tool_format = self.config.tool_call_parser
        tool_prompt = L3.TOOL_PROMPT if tool_format == "llama3_json" else DEFAULT_TOOL_PROMPT
        variables = template_kwargs(request.chat_template_kwargs, request.reasoning_effort)
        return await self.inputs.chat_prompt(
            request.messages, functions, tool_prompt, variables=variables
        )

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

    def observe(self, output: Output, timing: RequestTiming) -> None:
        self.metrics.observe_request(
            ttft=timing.ttft,
            itl_list=timing.itl,
            e2e=time.monotonic() - timing.started,
            prompt_tokens=output.num_prompt_tokens,
            generation_tokens=output.num_output_tokens,
            finished_reason=output.finish_reason or "abort",
        )
