"""`trillm.LLM`: offline batches without an event loop, named and shaped like `vllm.LLM`.

    with trillm.LLM() as llm:  # the built-in default model
        for result in llm.generate(["Hello, my name is"] * 100, SamplingParams(max_tokens=16)):
            print(result.outputs[0].text)

It runs the server's engine process and rings through `SyncEngineClient` (blocking waits with
timeouts, no trio), and the frontend's per-record pieces as they are: `InputProcessor`,
`OutputProcessor` (detokeniser, stop strings), `SamplingParams.child_options`. A batch is
checked whole, sent whole, then pumped until every request finished, with a tqdm bar over
requests; results come back in prompt order. `embed` runs pooling requests (prefill only, as
`AsyncLLM.encode`) through the same loop.
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio
from tqdm import tqdm  # type: ignore[import-untyped]

from ...common.wire import PoolingType, SamplingOptions
from ._engine_args import offline_config
from ._errors import EngineDeadError
from .engines._sync_client import SyncEngineClient
from .inputs._input_processor import InputProcessor
from .inputs._sampling_params import SamplingParams
from .inputs._tokenizer import load_tokenizer
from .outputs._output_processor import OutputProcessor, RequestState
from .outputs._outputs import Mailbox
from .outputs._pooling import PoolerConfig, finish_embedding, load_pooler_config
from .outputs._request_output import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    completion_output,
    prompt_logprobs,
)

# A prompt: text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}.
Prompt = str | Sequence[int] | Mapping[str, Any]
Conversation = list[dict[str, Any]]


@dataclass(slots=True, eq=False)
class _Request:
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    mailbox: Mailbox
    states: list[RequestState]
    unfinished: int
    pooling: PoolingType = PoolingType.NONE  # NONE: a generation


class LLM:
    """A model on an engine process, for batches of prompts from synchronous code.

    Args:
        model: a Hugging Face model directory or a GGUF file; None for the built-in default
            (SmolLM2-135M-Instruct, as `trillm serve`).
        **engine_args: settings of the worker, engine and frontend configs by name (dtype,
            max_model_len, max_num_seqs, seed, tensor_parallel_size, enable_prefix_caching,
            kv_cache_bytes, ...; `_engine_args` lists them).

    Raises:
        TypeError: an unknown engine argument (the message lists the known ones).
        ValueError: an engine argument out of range.
        EngineStartError: the engine failed before READY, with its own message.

    Close it (`close()`, or use it as a context manager): the engine is shut down and its
    shared memory released. Build it on a thread that outlives it (see `SyncEngineClient`).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.config = offline_config(model, engine_args)
        self._processor = OutputProcessor()
        self._rnums = itertools.count(1)
        self._request_ids = itertools.count()
        self._decoded: dict[int, str] = {}
        config = self.config
        self._client = SyncEngineClient(
            config.engine, self._processor, watchdog_timeout=config.watchdog_timeout
        )
        try:
            tokenizer_error: Exception | None = None
            try:  # while the engine loads its weights
                tokenizer = load_tokenizer(config.tokenizer or config.engine.worker.model)
                template = None
                if config.chat_template is not None:
                    with open(config.chat_template) as f:
                        template = f.read()
            except Exception as exc:  # the engine's own error, if any, says more: first
                tokenizer_error = exc
            ready = self._client.wait_ready(config.start_timeout)
            if tokenizer_error is not None:
                raise tokenizer_error
        except BaseException:
            self._client.shutdown(0, drain=False)
            raise
        self._inputs = InputProcessor(tokenizer, ready, template)
        self._pooler: PoolerConfig | None = None  # read from the model folder at first embed

    # -- requests --------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt; one `RequestOutput` per prompt, in order.

        Args:
            prompts: one prompt or a sequence of them (a flat sequence of ints is one prompt
                of token ids).
            sampling_params: one for all, or one per prompt; None is `SamplingParams()`.
            use_tqdm: show a progress bar over the requests.

        Raises:
            EngineDeadError: the engine died, naming the root cause (every later call too).
            PromptTooLongError, SamplingParamsError, ValueError: a bad prompt or parameter;
                nothing of the batch was sent.
            RequestFailedError: the engine refused one request (the rest were aborted).
        """
        items = _as_list(prompts)
        inputs = [self._tokenize(p) for p in items]
        params = self._params(sampling_params, len(items))
        requests = [
            self._request(text, ids, p) for (text, ids), p in zip(inputs, params, strict=True)
        ]
        self._run(requests, use_tqdm)
        return [self._result(request) for request in requests]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """`generate` on the chat template (`chat_template`, else the model's) applied to one
        conversation or to each of a sequence of them, ready for the assistant's reply.

        Raises:
            ChatTemplateError: the template refused a conversation (Gemma 2's "System role not
                supported") or failed on it; nothing of the batch was sent.
        """
        self._check_open()
        one = bool(messages) and isinstance(messages[0], Mapping)
        conversations: Sequence[Conversation] = [messages] if one else messages  # type: ignore[list-item,assignment]
        texts = [self._inputs.render_chat(list(c)) for c in conversations]
        params = self._params(sampling_params, len(texts))
        requests = [
            self._request(text, self._inputs.chat_ids(text), p)
            for text, p in zip(texts, params, strict=True)
        ]
        self._run(requests, use_tqdm)
        return [self._result(request) for request in requests]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
        dimensions: int | None = None,
        normalize: bool | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Embed every prompt (as vLLM's `LLM.embed`): one prefill-only pooling request each,
        pooled as the model's sentence-transformers files or `pooler_config` say (else the
        last token, normalised); one `EmbeddingRequestOutput` per prompt, in order.

        Args:
            truncate_prompt_tokens: keep only each prompt's last this many tokens.
            dimensions: cut each vector to its first this many (Matryoshka), then normalise.
            normalize: override the pooler's normalisation.

        Raises:
            PromptTooLongError: a prompt longer than the model's maximum length (cut it with
                `truncate_prompt_tokens`); nothing of the batch was sent.
            ValueError: `truncate_prompt_tokens` or `dimensions` below 1.
            EngineDeadError: the engine died.
        """
        for name, value in (
            ("truncate_prompt_tokens", truncate_prompt_tokens),
            ("dimensions", dimensions),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self._pooler is None:
            self._pooler = load_pooler_config(
                self.config.engine.worker.model, self.config.pooler_config
            )
        pooler = self._pooler
        requests = []
        for prompt in _as_list(prompts):
            text, ids = self._tokenize(prompt, will_truncate=truncate_prompt_tokens is not None)
            ids = self._inputs.pooling_ids(ids, truncate_prompt_tokens, "prompt")
            params = SamplingParams()
            requests.append(_Request(text, ids, params, 1, Mailbox(), [], 1, pooler.pooling_type))
        self._run(requests, use_tqdm)
        keep_unit = pooler.normalize if normalize is None else normalize
        results = []
        for request in requests:
            rows = request.mailbox.pending[0].pooled
            if rows is None:
                raise RuntimeError("a pooling request ended without its rows (an engine bug)")
            vector = finish_embedding(rows, normalize=keep_unit, dimensions=dimensions)[0]
            results.append(
                EmbeddingRequestOutput(
                    str(next(self._request_ids)),
                    request.token_ids,
                    EmbeddingOutput(vector.tolist()),
                )
            )
        return results

    def get_tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer."""
        return self._inputs.tokenizer

    def _tokenize(
        self, prompt: Prompt, *, will_truncate: bool = False
    ) -> tuple[str | None, list[int]]:
        self._check_open()
        tokenize = self._inputs.tokenize
        if isinstance(prompt, str):
            return prompt, tokenize(prompt, will_truncate=will_truncate)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), tokenize(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], tokenize(prompt["prompt"], will_truncate=will_truncate)
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got {prompt!r}")
        return None, tokenize(prompt)

    @staticmethod
    def _params(
        given: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        if given is None or isinstance(given, SamplingParams):
            return [given or SamplingParams()] * num_prompts
        if len(given) != num_prompts:
            raise ValueError(
                f"{len(given)} sampling params for {num_prompts} prompts: give one for all, "
                f"or one per prompt"
            )
        return list(given)

    def _run(self, requests: list[_Request], use_tqdm: bool) -> None:
        """Send every request, then pump until each ended (its outputs in its mailbox)."""
        self._check_open()
        self._client.check_alive()
        open_rnums: dict[int, _Request] = {}  # rnum -> its request, until that child ends
        processor = self._processor
        with tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm) as bar:
            try:
                for request in requests:
                    self._send(request, open_rnums)
                started, done_prompt = time.monotonic(), 0
                first_generated = self._processor.generation_tokens
                while open_rnums:
                    self._client.pump()
                    if len(processor) == len(open_rnums):
                        continue  # no child ended
                    for rnum in [r for r in open_rnums if r not in processor]:
                        request = open_rnums.pop(rnum)
                        if request.mailbox.error is not None:
                            raise request.mailbox.error
                        request.unfinished -= 1
                        if not request.unfinished:
                            done_prompt += len(request.token_ids)
                            bar.update(1)
                    elapsed = max(time.monotonic() - started, 1e-9)
                    generated = self._processor.generation_tokens - first_generated
                    bar.set_postfix_str(
                        f"est. speed input: {done_prompt / elapsed:.2f} toks/s, "
                        f"output: {generated / elapsed:.2f} toks/s",
                        refresh=False,
                    )
            finally:
                self._abandon(list(open_rnums))

    def _request(self, text: str | None, ids: list[int], params: SamplingParams) -> _Request:
        """A request checked whole before anything of its batch is sent."""
        if params.structured_outputs is not None:
            raise ValueError(
                "structured_outputs is not supported by trillm.LLM yet: use trillm serve or "
                "trillm.open_llm"
            )
        max_tokens = self._inputs.check_length(len(ids), params)
        vocab = self._inputs.ready.vocab_size
        params.child_options(0, vocab_size=vocab)  # token ids in range (raises)
        return _Request(text, ids, params, max_tokens, Mailbox(), [], params.n)

    def _send(self, request: _Request, open_rnums: dict[int, _Request]) -> None:
        vocab = self._inputs.ready.vocab_size
        for index in range(request.params.n):
            rnum = next(self._rnums)
            state = (
                self._inputs.new_pooling_state(
                    rnum, request.mailbox, request.token_ids, request.params.cache_salt or ""
                )
                if request.pooling
                else self._inputs.new_state(
                    rnum, request.mailbox, index, request.token_ids, request.params
                )
            )
            request.states.append(state)
            self._processor.add(state)
            open_rnums[rnum] = request
            options = (
                SamplingOptions(pooling=int(request.pooling))
                if request.pooling
                else request.params.child_options(index, vocab_size=vocab)
            )
            salt = request.params.cache_salt or ""
            self._client.send_add(
                rnum, options, request.max_tokens, request.token_ids, cache_salt=salt
            )

    def _abandon(self, rnums: list[int]) -> None:
        """Forget unfinished children (an error or an interrupt ended the batch); abort them."""
        for rnum in rnums:
            self._processor.forget(rnum)
        if rnums and self._client.error is None:
            with contextlib.suppress(EngineDeadError):  # its requests are gone with it
                self._client.send_abort(rnums)

    def _result(self, request: _Request) -> RequestOutput:
        outputs = [request.mailbox.pending[i] for i in range(request.params.n)]
        return RequestOutput(
            str(next(self._request_ids)),
            request.prompt,
            request.token_ids,
            prompt_logprobs(outputs[0], self._decode),
            [completion_output(output, self._decode) for output in outputs],
            num_cached_tokens=outputs[0].num_cached_tokens,
        )

    def _decode(self, token_id: int) -> str:
        text = self._decoded.get(token_id)
        if text is None:
            text = self._decoded[token_id] = self._inputs.tokenizer.decode([token_id])
        return text

    def _check_open(self) -> None:
        if self._client.error is not None and self._client.is_closed:
            raise trio.ClosedResourceError("this LLM was closed: make a new trillm.LLM")

    # -- life ------------------------------------------------------------------------------

    def close(self) -> None:
        """Shut the engine down (draining for at most `shutdown_timeout`), release its shared
        memory. A second call does nothing."""
        self._client.shutdown(self.config.shutdown_timeout)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | Mapping):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and isinstance(items[0], numbers.Integral):
        return [items]  # one prompt of token ids
    return items
