"""`AsyncLLM`: the trio frontend's client of the engine processes (DESIGN.md §8).

`open_llm` (`_open_llm`) spawns the engine (or `data_parallel_size` engines) under
supervision, loads the tokenizer meanwhile, and waits for READY. `AsyncLLM` owns requests:
`prepare` checks one (token ids, length, constraint) once, `generate` sends it and streams
its outputs, and `complete`, `chat` and `utility` build on them; `encode` sends a pooling
one. Both kinds go out and are aborted on exit through `_submit.open_request`. The engines,
their states, deaths, restarts and the routing of a request to one of them are the
`EnginePool`'s (`_engine_pool`). With `in_process` the one engine is a thread of this
process (`_inproc`). The constraint check is `inputs._structured_check`'s, LoRA loads
across the engines `inputs._lora`'s.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from ...common.wire import LoraModule, PoolingType, SamplingOptions
from ..protocol import _messages as P
from ._config import LLMConfig
from ._errors import EngineDeadError
from ._submit import open_request
from .engines._engine_pool import EnginePool
from .engines._restarts import RestartPolicy
from .inputs._input_processor import InputProcessor
from .inputs._lora import LoraAdapters, load_on_engines, unload_on_engines
from .inputs._prepared import PreparedRequest
from .inputs._prompt_embeds import PromptEmbeds
from .inputs._sampling_params import SamplingParams
from .inputs._structured_check import StructuredCheck
from .inputs._tokenizer import load_tokenizer
from .outputs._output_processor import OutputProcessor, RequestState
from .outputs._outputs import Mailbox, Output
from .outputs._pooling import PoolingOutput
from .outputs._streams import RequestStream, wait_pooled
from .outputs._token_pieces import TokenPieces


class AsyncLLM:
    """Submit requests to the engine and stream their outputs. Build with `open_llm`."""

    def __init__(self, config: LLMConfig) -> None:
        self.config = config
        self.tokenizer: Any = None
        self._structured = StructuredCheck(
            lambda: (self.tokenizer, self.ready.vocab_size),
            reasoning_parser=config.reasoning_parser,
            timeout=config.engine.structured_outputs_timeout,
            budget=config.grammar_budget,
        )
        self._chat_template: str | None = None  # LLMConfig.chat_template's text
        self._inputs: InputProcessor  # made once the tokenizer and READY are there
        self._rnums = itertools.count(1)
        self._processor = OutputProcessor()
        self.engines = EnginePool(config, self._processor)
        self.loras = LoraAdapters(config.engine.lora_modules)  # LoRA adapters by name
        self.engines.lora_modules = self.loras.modules
        self.engines.on_ready = self._on_engine_ready
        self.ready: P.Ready
        self.token_pieces: TokenPieces  # logprobs' token text and bytes, with the tokenizer

    @property
    def errored(self) -> bool:
        """True once every engine died; every later call raises `EngineDeadError`."""
        return self.engines.error is not None

    @property
    def error(self) -> EngineDeadError | None:
        """Why the (last) engine died (what every later call raises), or None while one lives."""
        return self.engines.error

    async def wait_dead(self) -> EngineDeadError:
        """Wait until every engine died (or was shut down); return why."""
        return await self.engines.wait_dead()

    @property
    def restarting(self) -> bool:
        """Whether an engine is being started again (no request reaches it meanwhile)."""
        return self.engines.restarting

    @property
    def restarts(self) -> RestartPolicy:
        """The engines' restart bound, and how many times one was started again (`total`)."""
        return self.engines.restarts

    def live_engines(self) -> list[int]:
        """Indexes of the engines alive and serving (not dead, not restarting)."""
        return self.engines.live()

    @property
    def max_model_len(self) -> int:
        return self.ready.max_model_len

    @property
    def num_request_states(self) -> int:
        """Per-choice request states held (unfinished requests); 0 when idle, or it leaks."""
        return len(self._processor)

    # -- requests ------------------------------------------------------------------------

    async def prepare(
        self,
        prompt: str | Sequence[int] | PromptEmbeds,
        params: SamplingParams | None = None,
        *,
        run: Callable[[Callable[[], Any]], Awaitable[Any]] | None = None,
        data_parallel_rank: int | None = None,
        lora_name: str | None = None,
    ) -> PreparedRequest:
        """`prompt` checked whole, once, for `generate`: tokenised (ids checked against the
        vocabulary), its length against the model's, its constraint compiled. `run` runs the
        tokenising (the server hands it to a thread when the prompt is large).
        `data_parallel_rank` pins it to that engine (vLLM's), instead of the router's choice.
        A `PromptEmbeds` prompt (`LLMConfig.enable_prompt_embeds`) takes the place of the
        token embeddings of as many placeholder ids. `lora_name` runs it with that LoRA
        adapter (None: the base model).

        Raises:
            LoraNotFoundError: no adapter `lora_name` is loaded.
            DataParallelRankError: `data_parallel_rank` is not in [0, data_parallel_size).
            PromptEmbedsError: prompt embeddings are off, or do not fit the model.
            InvalidPromptError: an empty prompt or a token id outside the vocabulary.
            PromptTooLongError: prompt + max_tokens exceed the model's maximum length (its
                `param` says which to change).
            SamplingParamsError: invalid parameters.
            StructuredOutputError: `params.structured_outputs` is invalid, too large, or was
                not checked in time.
            EngineDeadError: every engine died.
        """
        self.engines.check_alive()
        params = params or SamplingParams()
        lora_id = self.loras.id_of(lora_name)
        self.engines.check_rank(data_parallel_rank)
        enabled = self.config.enable_prompt_embeds
        checked = functools.partial(self._inputs.prompt_ids, prompt, params, embeds=enabled)
        token_ids, max_tokens = checked() if run is None else await run(checked)
        grammar = await self.check_structured(params)
        data = prompt.data if isinstance(prompt, PromptEmbeds) else b""
        rank = data_parallel_rank
        return PreparedRequest(token_ids, params, max_tokens, grammar, rank, data, lora_id)

    @asynccontextmanager
    async def generate(
        self,
        request: PreparedRequest | str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        data_parallel_rank: int | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestStream]:
        """Submit a request (`prepare`d, or a prompt and `params` to prepare now, pinned to
        engine `data_parallel_rank` if given); yields its stream.

        Leaving the block before every child finished (break, exception, cancellation)
        aborts the request in the engine.

        Raises:
            EngineDeadError: the engine died (before or during the request).
            EngineRestartingError: every engine (or the pinned one) restarts, and none came
                back in time.
            PinnedEngineDeadError: the pinned engine is dead for good (others may serve).
            What `prepare` raises, when given a prompt.
            RequestFailedError: (from the stream) the engine failed this request alone,
                e.g. its grammar did not compile within the deadline.
        """
        if not isinstance(request, PreparedRequest):
            request = await self.prepare(
                request, params, data_parallel_rank=data_parallel_rank, lora_name=lora_name
            )
        params, token_ids = request.params, request.token_ids
        salt, rank = params.cache_salt or "", request.data_parallel_rank
        engine = await self.engines.choose(token_ids, salt, rank)
        mailbox = Mailbox()
        states = [
            self._inputs.new_state(
                next(self._rnums), mailbox, i, token_ids, params, request.prompt_embeds
            )
            for i in range(params.n)
        ]
        for state in states:
            state.lora_id = request.lora_id

        def fill(state: RequestState) -> None:
            options = params.child_options(state.index, vocab_size=self.ready.vocab_size)
            state.options, state.max_tokens = options, request.max_tokens
            state.grammar = request.grammar

        async with open_request(self.engines, engine, states, fill):
            yield RequestStream(mailbox, params.n)

    async def complete(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        data_parallel_rank: int | None = None,
        lora_name: str | None = None,
    ) -> list[Output]:
        """Generate to the end; one merged `Output` per child (index order)."""
        merged: dict[int, Output] = {}
        pinned, lora = data_parallel_rank, lora_name
        async with self.generate(
            prompt, params, data_parallel_rank=pinned, lora_name=lora
        ) as stream:
            async for output in stream:
                if output.index in merged:
                    merged[output.index].merge(output)
                else:
                    merged[output.index] = output
        return [merged[i] for i in sorted(merged)]

    async def encode(
        self,
        prompt: str | Sequence[int],
        pooling: PoolingType = PoolingType.LAST,
        *,
        truncate_prompt_tokens: int | None = None,
        add_special_tokens: bool = True,
        cache_salt: str | None = None,
        data_parallel_rank: int | None = None,
        run: Callable[[Callable[[], Any]], Awaitable[Any]] | None = None,
    ) -> PoolingOutput:
        """Pool `prompt`'s final hidden states (embeddings): a prefill-only request in the
        same engine as generation, which samples nothing and ends the step its prompt does.
        The rows come raw (float32, neither cut nor normalised: `_pooling.finish_embedding`).

        Args:
            truncate_prompt_tokens: keep only the prompt's last this many tokens (vLLM's).
            add_special_tokens: the tokenizer's special tokens around a text (vLLM's).
            cache_salt: its tenant's prefix-cache salt, as generation's (LAST pooling reads
                cached blocks: another salt's are never hits).
            data_parallel_rank: the engine to run on (vLLM's), as `prepare`'s.
            run: runs the tokenising (the server hands it to a thread when it is large).

        Raises:
            InvalidPromptError: an empty prompt or a token id outside the vocabulary.
            PromptTooLongError: more tokens than the model's maximum length (param "input").
            SamplingParamsError: an empty or over-long `cache_salt`.
            DataParallelRankError: `data_parallel_rank` is not in [0, data_parallel_size).
            EngineDeadError: every engine died.
        """
        self.engines.check_alive()
        salt = SamplingParams(cache_salt=cache_salt).cache_salt or ""  # checked as generation's
        self.engines.check_rank(data_parallel_rank)

        def checked() -> list[int]:
            cut, special = truncate_prompt_tokens is not None, add_special_tokens
            ids = self._inputs.tokenize(prompt, will_truncate=cut, add_special_tokens=special)
            return self._inputs.pooling_ids(ids, truncate_prompt_tokens, "input")

        ids: list[int] = checked() if run is None else await run(checked)
        options = SamplingOptions(pooling=int(pooling))
        engine = await self.engines.choose(ids, salt, data_parallel_rank)
        mailbox = Mailbox()
        state = self._inputs.new_pooling_state(next(self._rnums), mailbox, ids, salt)
        state.options, state.max_tokens = options, 1
        async with open_request(self.engines, engine, [state]):
            return await wait_pooled(mailbox, len(ids))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The chat template (`LLMConfig.chat_template`, else the model's) over `messages`,
        ready for a reply (unless `add_generation_prompt` is false; with
        `continue_final_message`, the final message left open to be continued), as token ids;
        `tools` go to a template that reads them, `variables` (chat_template_kwargs) to the
        template.

        Raises:
            ChatTemplateError: the model has no chat template, or it refused the messages
                (Gemma 2's "System role not supported") or failed on them.
        """
        text = self._inputs.render_chat(
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            variables=variables,
        )
        return self._inputs.chat_ids(text)

    @property
    def chat_template(self) -> str | None:
        """The chat template requests render with: --chat-template's, else the tokenizer's."""
        template: str | None = self._chat_template or self.tokenizer.chat_template
        return template

    @property
    def template_reads_tools(self) -> bool:
        """Whether the chat template renders `tools` (else callers describe them)."""
        template = self._chat_template or self.tokenizer.chat_template or ""
        return "tools" in template

    @asynccontextmanager
    async def chat(
        self, messages: list[dict[str, Any]], params: SamplingParams | None = None
    ) -> AsyncIterator[RequestStream]:
        """`generate` on the chat template applied to `messages`.

        Raises:
            ChatTemplateError: the template refused the messages; nothing was sent.
        """
        async with self.generate(self.apply_chat_template(messages), params) as stream:
            yield stream

    async def check_structured(self, params: SamplingParams) -> str:
        """The checked grammar of `params.structured_outputs` ("" for none), so a bad one is
        refused before a response starts (`prepare` calls it; a grammar is checked once, then
        cached).

        Raises:
            StructuredOutputError: invalid, too large, or not checked in time.
        """
        return await self._structured.check(params)

    async def utility(
        self, method: str, engine: int | None = None, args: list[object] | None = None
    ) -> object:
        """Call an allow-listed engine utility (`UTILITY_METHODS`: reset_prefix_cache, stats,
        sleep, pause, start_profile, ...) with `args` on `engine` (default: the first live one).

        Raises:
            ValueError: `method` is not on the allow-list (it never reaches the engine), or
                the engine refused the call; the message says why.
        """
        if method not in P.UTILITY_METHODS:
            raise ValueError(
                f"unknown utility method {method!r}: one of {', '.join(sorted(P.UTILITY_METHODS))}"
            )
        target = self.engines.serving(engine)
        ok, result = await target.utility(next(self._rnums), method, args)
        if target.dead:
            self.engines.check_engine(target)
        if not ok:
            raise ValueError(str(result))
        return result

    async def load_lora_adapter(
        self, name: str, path: str, base_model_name: str | None = None
    ) -> LoraModule:
        """Load a LoRA adapter (a PEFT directory) on every engine; requests may then name it.

        Raises:
            LoraAdapterExistsError: `name` is loaded already.
            ValueError: an engine refused it (LoRA off, a bad adapter); the message says why,
                and no engine keeps it.
        """
        engines = self.live_engines()
        return await load_on_engines(self.loras, self.utility, engines, name, path, base_model_name)

    async def unload_lora_adapter(self, name: str) -> LoraModule:
        """Unload adapter `name`: new requests for it are refused at once; requests running
        with it end with it.

        Raises:
            LoraNotFoundError: no adapter of that name is loaded.
        """
        engines = self.live_engines()
        return await unload_on_engines(self.loras, self.utility, engines, name)

    # -- life ----------------------------------------------------------------------------

    async def _start(self, nursery: trio.Nursery) -> None:
        self.engines.spawn(nursery)
        tokenizer_error: BaseException | None = None
        try:  # while the engines load their weights
            self.tokenizer = await trio.to_thread.run_sync(load_tokenizer, self._tokenizer_path())
            if self.config.chat_template is not None:
                with open(self.config.chat_template) as f:
                    self._chat_template = f.read()
        except Exception as exc:  # the engine's own error, if any, says more: report it first
            tokenizer_error = exc
        await self.engines.wait_ready()
        self.ready = self.engines[0].ready
        if tokenizer_error is not None:
            raise tokenizer_error
        self._inputs = InputProcessor(self.tokenizer, self.ready, self._chat_template)
        self.token_pieces = TokenPieces(self.tokenizer)
        self.engines.start_tasks()

    def _on_engine_ready(self, ready: P.Ready) -> None:
        self.loras.reconcile(ready.loras)

    def _tokenizer_path(self) -> str:
        return self.config.tokenizer or self.config.engine.worker.model
