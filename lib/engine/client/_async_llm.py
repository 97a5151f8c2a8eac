"""`AsyncLLM`: the trio frontend's client of the engine process (DESIGN.md §8).

`open_llm` spawns the engine under supervision (trio process API, pidfd), waits for READY,
and runs two tasks in its own nursery: the output pump (STEP records -> mailboxes) and the
supervisor (the engine's exit -> every ring waiter breaks). Engine death, whether told by a
DEAD record or seen as the process exit, fails every open request in one synchronous pass
with an `EngineDeadError` naming the root cause; later calls raise it at once. A watchdog
kills an engine whose heartbeat stopped (SIGSTOP: alive to the pidfd, dead to its clients).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import numpy as np
import trio

from ..protocol import _messages as P
from ..protocol._errors import RemoteError
from ..protocol._step_record import StepView
from ._config import LLMConfig
from ._detokenizer import IncrementalDetokenizer, StopChecker
from ._errors import EngineDeadError, PromptTooLongError, RequestFailedError
from ._launch import EngineStartError, spawn_engine
from ._output_processor import OutputProcessor, RequestState
from ._outputs import Mailbox, Output
from ._sampling_params import SamplingParams
from ._streams import RequestStream, load_tokenizer, prompt_logprobs_output
from ._structured import GrammarChecker, after_reasoning, build_ll_tokenizer
from ._watchdog import not_responding_error, wait_heartbeat_stopped


class AsyncLLM:
    """Submit requests to the engine and stream their outputs. Build with `open_llm`."""

    def __init__(self, config: LLMConfig) -> None:
        self.config = config
        self.tokenizer: Any = None
        self._grammar_checker: GrammarChecker | None = None
        self._chat_template: str | None = None  # LLMConfig.chat_template's text
        self._backend: Any = None
        self._rnums = itertools.count(1)
        self._processor = OutputProcessor()
        self._encoder = msgspec.msgpack.Encoder()
        self._dead: EngineDeadError | None = None
        self._died = trio.Event()
        self._exit_error: RemoteError | None = None
        self._send_lock = trio.StrictFIFOLock()  # one writer task at a time on the request ring
        self.ready: P.Ready

    @property
    def errored(self) -> bool:
        """True once the engine died; every later call raises `EngineDeadError`."""
        return self._dead is not None

    @property
    def error(self) -> EngineDeadError | None:
        """Why the engine died (what every later call raises), or None while it lives."""
        return self._dead

    async def wait_dead(self) -> EngineDeadError:
        """Wait until the engine died (or was shut down); return why."""
        await self._died.wait()
        assert self._dead is not None
        return self._dead

    @property
    def max_model_len(self) -> int:
        return self.ready.max_model_len

    @property
    def num_request_states(self) -> int:
        """Per-choice request states held (unfinished requests); 0 when idle, or it leaks."""
        return len(self._processor.states)

    # -- requests ------------------------------------------------------------------------

    @asynccontextmanager
    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> AsyncIterator[RequestStream]:
        """Submit `prompt` (text or token ids); yields its stream.

        Leaving the block before every child finished (break, exception, cancellation)
        aborts the request in the engine.

        Raises:
            EngineDeadError: the engine died (before or during the request).
            PromptTooLongError: prompt + max_tokens exceed the engine's max model length.
            SamplingParamsError: invalid parameters.
            StructuredOutputError: `params.structured_outputs` is invalid, too large, or was
                not checked in time (before anything is sent).
            RequestFailedError: (from the stream) the engine failed this request alone,
                e.g. its grammar did not compile within the deadline.
        """
        self._check_alive()
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt)
        max_tokens = self.check_length(len(token_ids), params)
        grammar = await self.check_structured(params)
        mailbox = Mailbox()
        states = [self._new_state(mailbox, i, token_ids, params) for i in range(params.n)]
        for state in states:
            self._processor.states[state.rnum] = state
        try:
            for state in states:
                options = params.child_options(state.index, vocab_size=self.ready.vocab_size)
                await self._send_add(state.rnum, options, max_tokens, token_ids, grammar)
            self._processor.stats.prompt_tokens += len(token_ids) * params.n
            yield RequestStream(mailbox, params.n)
        finally:
            unfinished = [s.rnum for s in states if not s.finished]
            for rnum in unfinished:
                self._processor.states.pop(rnum, None)
            if unfinished and self._dead is None:
                with trio.CancelScope(shield=True):
                    await self._send_abort(unfinished)

    async def complete(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> list[Output]:
        """Generate to the end; one merged `Output` per child (index order)."""
        merged: dict[int, Output] = {}
        async with self.generate(prompt, params) as stream:
            async for output in stream:
                if output.index in merged:
                    merged[output.index].merge(output)
                else:
                    merged[output.index] = output
        return [merged[i] for i in sorted(merged)]

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The chat template (`LLMConfig.chat_template`, else the model's) over `messages`,
        ready for a reply, as token ids; `tools` go to a template that reads them."""
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=self._chat_template,
            tokenize=False,
            add_generation_prompt=True,
        )
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids

    @property
    def template_reads_tools(self) -> bool:
        """Whether the chat template renders `tools` (else callers describe them)."""
        template = self._chat_template or self.tokenizer.chat_template or ""
        return "tools" in template

    @asynccontextmanager
    async def chat(
        self, messages: list[dict[str, Any]], params: SamplingParams | None = None
    ) -> AsyncIterator[RequestStream]:
        """`generate` on the chat template applied to `messages`."""
        async with self.generate(self.apply_chat_template(messages), params) as stream:
            yield stream

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """`prompt` as token ids (text is tokenised; ids are checked against the vocabulary).

        Raises:
            ValueError: an empty prompt or a token id outside the vocabulary.
        """
        if isinstance(prompt, str):
            ids: list[int] = self.tokenizer(prompt)["input_ids"]
        else:
            ids = list(prompt)
            vocab = self.ready.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if not ids:
            raise ValueError("the prompt is empty: send at least one token")
        return ids

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

    def _new_state(
        self, mailbox: Mailbox, index: int, token_ids: list[int], params: SamplingParams
    ) -> RequestState:
        stops = params.stop_strings
        return RequestState(
            rnum=next(self._rnums),
            index=index,
            mailbox=mailbox,
            detokenizer=IncrementalDetokenizer(
                self._backend, token_ids, skip_special_tokens=params.skip_special_tokens
            ),
            stop=StopChecker(stops, params.include_stop_str_in_output) if stops else None,
            num_prompt_tokens=len(token_ids),
            prompt_token_ids=token_ids,
            logprobs=params.logprobs,
            arrival_time=time.monotonic(),
        )

    async def check_structured(self, params: SamplingParams) -> str:
        """The checked grammar of `params.structured_outputs` ("" for none), so a bad one is
        refused before a response starts (`generate` checks it too: once, it is cached).

        Raises:
            StructuredOutputError: invalid, too large, or not checked in time.
        """
        if params.structured_outputs is None:
            return ""
        if self._grammar_checker is None:
            tokenizer, vocab = self.tokenizer, self.ready.vocab_size
            self._grammar_checker = GrammarChecker(
                lambda: build_ll_tokenizer(tokenizer, vocab),
                timeout=self.config.engine.structured_outputs_timeout,
            )
        grammar = await self._grammar_checker.check(params.structured_outputs)
        if self.config.reasoning_parser is not None:
            grammar = after_reasoning(grammar, self.config.reasoning_parser)
        return grammar

    async def _send_add(
        self, rnum: int, options: Any, max_tokens: int, ids: list[int], grammar: str = ""
    ) -> None:
        add = P.AddHeader(rnum, options, max_tokens, time.time(), grammar)
        header = self._encoder.encode(add)
        offset, size = P.add_size(header, len(ids))
        async with self._send_lock:
            view = await self._reserve(size)
            P.pack_add(view, header, offset)
            view[offset:size] = np.asarray(ids, "<i4").view(np.uint8).data
            self._requests.commit(P.ADD)

    async def _send(self, kind: int, data: bytes) -> None:
        async with self._send_lock:
            view = await self._reserve(len(data))
            view[:] = data
            self._requests.commit(kind)

    async def _send_abort(self, rnums: list[int]) -> None:
        await self._send(P.ABORT, np.asarray(rnums, "<u8").tobytes())

    async def _reserve(self, size: int) -> memoryview:
        """Room in the request ring (the caller holds `_send_lock`: one waiter at a time)."""
        try:
            return await self._requests.reserve_async(size)
        except trio.BrokenResourceError:
            self._check_alive()
            raise

    async def utility(self, method: str) -> object:
        """Call an allow-listed engine utility (reset_prefix_cache, stats, ping)."""
        self._check_alive()
        call_id = next(self._rnums)
        event = trio.Event()
        self._utility_waiters[call_id] = (event, [])
        await self._send(P.UTILITY, self._encoder.encode(P.UtilityCall(call_id, method)))
        await event.wait()
        self._check_alive()
        ok, result = self._utility_waiters.pop(call_id)[1]
        if not ok:
            raise ValueError(str(result))
        return result

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead

    # -- life ----------------------------------------------------------------------------

    async def _start(self, nursery: trio.Nursery) -> None:
        self._utility_waiters: dict[int, tuple[trio.Event, list[Any]]] = {}
        # `spawn_engine` forks from this thread, not a trio worker thread as
        # `trio.lowlevel.open_process` would: the engine's parent-death signal follows the
        # forking *thread*, which trio reaps when idle (the engine was SIGKILLed ~10 s in).
        self._process, self._requests, self._outputs = spawn_engine(self.config.engine)
        self._pidfd = os.pidfd_open(self._process.pid)
        self._exited = trio.Event()
        nursery.start_soon(self._supervise)
        tokenizer_error: BaseException | None = None
        try:  # while the engine loads its weights
            self.tokenizer = await trio.to_thread.run_sync(load_tokenizer, self._tokenizer_path())
            if self.config.chat_template is not None:
                with open(self.config.chat_template) as f:
                    self._chat_template = f.read()
            self._backend = self.tokenizer.backend_tokenizer
        except Exception as exc:  # the engine's own error, if any, says more: report it first
            tokenizer_error = exc
        with trio.move_on_after(self.config.start_timeout) as scope:
            try:
                await self._requests.wait_attached_async()
                await self._outputs.wait_attached_async()
                kind, payload = await self._outputs.peek_async()
            except trio.BrokenResourceError:
                kind, payload = await self._last_words()
            data = bytes(payload)
            self._outputs.release()
        if scope.cancelled_caught:
            raise EngineStartError(
                RemoteError("engine", "TimeoutError", f"not ready in {self.config.start_timeout} s")
            )
        if kind == P.DEAD:
            raise EngineStartError(msgspec.msgpack.decode(data, type=RemoteError))
        if kind != P.READY:
            raise EngineStartError(RemoteError("engine", "ProtocolError", f"record kind {kind}"))
        self.ready = msgspec.msgpack.decode(data, type=P.Ready)
        if tokenizer_error is not None:
            raise tokenizer_error
        nursery.start_soon(self._pump)
        if self.config.watchdog_timeout:
            nursery.start_soon(self._watchdog)

    def _tokenizer_path(self) -> str:
        return self.config.tokenizer or self.config.engine.worker.model

    async def _last_words(self) -> tuple[int, memoryview]:
        """After the engine exited: its DEAD record if it wrote one, else its exit."""
        try:
            record = self._outputs.try_peek()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            record = None  # it wrote nothing before it died
        if record is not None:
            return record
        error = self._exit_error or RemoteError("engine", "RuntimeError", "exited")
        raise EngineStartError(error)

    async def _supervise(self) -> None:
        """Wait for the engine process to exit (its pidfd); then every ring waiter breaks."""
        try:
            await trio.lowlevel.wait_readable(self._pidfd)
        except trio.ClosedResourceError:
            return  # `_shutdown` closed the pidfd: nothing is left to supervise
        code = self._process.wait()  # it exited: this reaps it at once
        self._exited.set()
        self._exit_error = (
            RemoteError("engine", signal=-code)
            if code < 0
            else RemoteError("engine", exit_code=code)
        )
        reason = "the engine process " + (
            f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        )
        for ring in (self._requests, self._outputs):
            ring.declare_peer_dead(reason)

    async def _pump(self) -> None:
        """Read every output-ring record; one pass per STEP; ends with the engine."""
        reader = self._outputs
        processor = self._processor
        while True:
            try:
                kind, payload = await reader.peek_async()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._die(self._exit_error or RemoteError("engine", exit_code=None))
                return
            if kind == P.STEP:
                to_abort = processor.process_step(StepView(payload))
                reader.release()
                if to_abort:
                    await self._send_abort(to_abort)
            elif kind == P.EVENT:
                self._event(msgspec.msgpack.decode(payload, type=P.Event))
                reader.release()
            elif kind == P.DEAD:
                error = msgspec.msgpack.decode(payload, type=RemoteError)
                reader.release()
                self._die(error)
                return
            else:
                reader.release()

    async def _watchdog(self) -> None:
        """Declare the engine dead, and kill it, when its heartbeat stops (`_heartbeat`)."""
        timeout = self.config.watchdog_timeout
        still = await wait_heartbeat_stopped(self._outputs, timeout)
        if self._dead is not None or self._exited.is_set():
            return  # it died or exited anyway: the supervisor tells how
        self._die(not_responding_error(self._process.pid, still, timeout))
        self._process.kill()  # the supervisor reaps it; its workers die with it

    def _event(self, event: P.Event) -> None:
        if event.kind == "prompt_logprobs":
            state = self._processor.states.get(event.rnum)
            if state is not None and state.mailbox.put(prompt_logprobs_output(state, event)):
                state.mailbox.wake()
        elif event.kind == "request_error":  # this request alone failed in the engine
            state = self._processor.states.pop(event.rnum, None)
            if state is not None and state.mailbox.fail(RequestFailedError(str(event.result))):
                state.mailbox.wake()
        elif event.kind == "utility_result":
            waiter = self._utility_waiters.get(event.call_id)
            if waiter is not None:
                waiter[1].extend((event.ok, event.result))
                waiter[0].set()

    def _die(self, error: RemoteError) -> None:
        if self._dead is not None:
            return
        self._dead = EngineDeadError(error)
        self._processor.fail_all(self._dead)
        for event, _ in self._utility_waiters.values():
            event.set()
        self._died.set()

    async def _shutdown(self) -> None:
        """Drain the engine (bounded), then make sure it is gone and the rings are closed."""
        with trio.CancelScope(shield=True):
            if self._dead is None and self._process.poll() is None:
                data = self._encoder.encode(P.Shutdown("drain", self.config.shutdown_timeout))
                view = self._requests.try_reserve(len(data))
                if view is not None:
                    view[:] = data
                    self._requests.commit(P.SHUTDOWN)
            with trio.move_on_after(self.config.shutdown_timeout + 5):
                await self._exited.wait()
            if self._process.poll() is None:
                self._process.kill()
            self._process.wait()
            trio.lowlevel.notify_closing(self._pidfd)
            os.close(self._pidfd)
            self._die(RemoteError("engine", "EngineShutdown", "the engine was shut down"))
            self._requests.close()
            self._outputs.close()


@asynccontextmanager
async def open_llm(config: LLMConfig) -> AsyncIterator[AsyncLLM]:
    """Start the engine process and yield an `AsyncLLM`; on exit shut the engine down.

    Raises:
        EngineStartError: the engine failed before READY (bad model path, out of memory...),
            with its own message.
    """
    llm = AsyncLLM(config)
    try:
        async with trio.open_nursery() as nursery:
            try:
                await llm._start(nursery)
                yield llm
            finally:
                if hasattr(llm, "_process"):
                    await llm._shutdown()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # one error (ours or the caller's): raise it as is
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from group.exceptions[0].__cause__
        raise
