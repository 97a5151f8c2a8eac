"""`AsyncLLM`: the trio frontend's client of the engine processes (DESIGN.md §8).

`open_llm` spawns the engine (or `data_parallel_size` engines) under supervision (pidfd),
waits for READY, and runs each engine's tasks in its own nursery (`_engine_client`: the
output pump, the supervisor, the watchdog). A request goes to one engine (`_router`: by
load, with prefix affinity). An engine's death, told by a DEAD record, seen as the process
exit or declared by the watchdog (SIGSTOP: alive to the pidfd, dead to its clients), is
logged with its root cause; within `max_engine_restarts` the engine is started again and its
open requests resume on it (`_resume`: prompt + tokens so far; a poison request is found and
fails alone). Past the bound, that engine's open requests fail in one synchronous pass with
an `EngineDeadError` naming the root cause (and the engine, under data parallelism); the
others keep serving. Once every engine is dead, every later call raises it at once. With
`in_process` the one engine is a thread of this process (`_inproc`).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from ..protocol import _messages as P
from ..protocol._errors import RemoteError
from ._config import LLMConfig
from ._engine_client import EngineClient
from ._errors import EngineDeadError, EngineRestartingError
from ._input_processor import InputProcessor
from ._launch import EngineStartError
from ._output_processor import OutputProcessor
from ._outputs import Mailbox, Output
from ._restarts import RestartPolicy
from ._resume import judge, poison_error, release_quarantined, resend
from ._router import EngineRouter
from ._sampling_params import SamplingParams
from ._streams import RequestStream
from ._structured import GrammarChecker, after_reasoning, build_ll_tokenizer
from ._tokenizer import load_tokenizer


class AsyncLLM:
    """Submit requests to the engine and stream their outputs. Build with `open_llm`."""

    def __init__(self, config: LLMConfig) -> None:
        self.config = config
        self.tokenizer: Any = None
        self._grammar_checker: GrammarChecker | None = None
        self._chat_template: str | None = None  # LLMConfig.chat_template's text
        self._inputs: InputProcessor  # made once the tokenizer and READY are there
        self._rnums = itertools.count(1)
        self._processor = OutputProcessor()
        self._dead: EngineDeadError | None = None  # set once every engine is dead
        self._died = trio.Event()
        self.engines: list[EngineClient] = []
        self.engine_errors: dict[int, EngineDeadError] = {}  # engine index -> why it died
        self._shutting_down = False
        self.restarts = RestartPolicy(config.max_engine_restarts, config.engine_restart_window)
        self._engine_back = trio.Event()  # set (and renewed) when a restarted engine is READY
        self._restarting: set[int] = set()  # engine indexes being started again
        self._router = EngineRouter(config.data_parallel_size, config.engine.worker.block_size)
        self.ready: P.Ready

    @property
    def errored(self) -> bool:
        """True once every engine died; every later call raises `EngineDeadError`."""
        return self._dead is not None

    @property
    def error(self) -> EngineDeadError | None:
        """Why the (last) engine died (what every later call raises), or None while one lives."""
        return self._dead

    async def wait_dead(self) -> EngineDeadError:
        """Wait until every engine died (or was shut down); return why."""
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
        await self._wait_for_an_engine()
        engine = self.engines[self._router.choose(token_ids)]
        mailbox = Mailbox()
        states = [
            self._inputs.new_state(next(self._rnums), mailbox, i, token_ids, params)
            for i in range(params.n)
        ]
        for state in states:
            state.engine = engine.index
            self._processor.states[state.rnum] = state
        self._router.loads[engine.index] += params.n
        try:
            for state in states:
                options = params.child_options(state.index, vocab_size=self.ready.vocab_size)
                state.options, state.max_tokens, state.grammar = options, max_tokens, grammar
                try:
                    await engine.send_add(state.rnum, options, max_tokens, token_ids, grammar)
                except trio.BrokenResourceError:
                    self._raise_engine_error(engine)
                    raise
                state.on_engine = True
            yield RequestStream(mailbox, params.n)
        finally:
            self._router.loads[engine.index] -= params.n
            unfinished = [s.rnum for s in states if not s.finished]
            for rnum in unfinished:
                self._processor.states.pop(rnum, None)
            if unfinished and not engine.dead:
                # it may die meanwhile: its requests are gone with it
                gone = (trio.BrokenResourceError, trio.ClosedResourceError)
                with trio.CancelScope(shield=True), contextlib.suppress(*gone):
                    await engine.send_abort(unfinished)

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
        ready for a reply, as token ids; `tools` go to a template that reads them.

        Raises:
            ChatTemplateError: the model has no chat template, or it refused the messages
                (Gemma 2's "System role not supported") or failed on them.
        """
        return self._inputs.chat_ids(self._inputs.render_chat(messages, tools))

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

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """`prompt` as token ids (text is tokenised; ids are checked against the vocabulary).

        Raises:
            ValueError: an empty prompt or a token id outside the vocabulary.
        """
        return self._inputs.tokenize(prompt)

    def check_length(self, num_prompt: int, params: SamplingParams) -> int:
        """The request's max_tokens, checked against the model's maximum length.

        Raises:
            PromptTooLongError: prompt + max_tokens exceed it (the message quotes both).
        """
        return self._inputs.check_length(num_prompt, params)

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
                budget=self.config.grammar_budget,
            )
        grammar = await self._grammar_checker.check(params.structured_outputs)
        if self.config.reasoning_parser is not None:
            grammar = after_reasoning(grammar, self.config.reasoning_parser)
        return grammar

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
        self._check_alive()
        target = self._live_engine(engine)
        ok, result = await target.utility(next(self._rnums), method, args)
        if target.dead:
            self._raise_engine_error(target)
        if not ok:
            raise ValueError(str(result))
        return result

    async def _wait_for_an_engine(self) -> None:
        """Return once an engine is alive; while every engine restarts, wait (at most
        `engine_restart_wait`) instead of failing.

        Raises:
            EngineRestartingError: none came back in time (the restart goes on).
            EngineDeadError: none is alive or coming back.
        """
        self._check_alive()
        wait = self.config.engine_restart_wait
        with trio.move_on_after(wait):
            while not self.live_engines():
                await self._engine_back.wait()
                self._check_alive()
        self._check_alive()
        if not self.live_engines():
            raise EngineRestartingError(next(iter(self.engine_errors.values())).error, wait)

    @property
    def restarting(self) -> bool:
        """Whether an engine is being started again (no request reaches it meanwhile)."""
        return bool(self._restarting)

    def live_engines(self) -> list[int]:
        """Indexes of the engines alive and serving (not dead, not restarting)."""
        return [e.index for e in self.engines if not e.dead and e.index not in self._restarting]

    def _live_engine(self, index: int | None) -> EngineClient:
        if index is not None:
            engine = self.engines[index]
            self._raise_engine_error(engine)
            return engine
        live = self.live_engines()
        if not live:  # every engine is restarting
            raise next(iter(self.engine_errors.values()))
        return self.engines[live[0]]

    def _raise_engine_error(self, engine: EngineClient) -> None:
        if engine.index in self.engine_errors:
            raise self.engine_errors[engine.index]

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead

    # -- life ----------------------------------------------------------------------------

    async def _start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        configs = self.config.engine_configs()
        in_process = self.config.in_process
        for i, config in enumerate(configs):
            name = "engine" if len(configs) == 1 else f"engine {i}"
            engine = EngineClient(
                i, name, config, self._processor, self._on_engine_death, in_process=in_process
            )
            self.engines.append(engine)
            engine.spawn(nursery)
        tokenizer_error: BaseException | None = None
        try:  # while the engines load their weights
            self.tokenizer = await trio.to_thread.run_sync(load_tokenizer, self._tokenizer_path())
            if self.config.chat_template is not None:
                with open(self.config.chat_template) as f:
                    self._chat_template = f.read()
        except Exception as exc:  # the engine's own error, if any, says more: report it first
            tokenizer_error = exc
        deadline = trio.current_time() + self.config.start_timeout
        for engine in self.engines:
            remaining = max(0.0, deadline - trio.current_time())
            await engine.wait_ready(remaining, self._watchdog_timeout)
        self.ready = self.engines[0].ready
        if tokenizer_error is not None:
            raise tokenizer_error
        self._inputs = InputProcessor(self.tokenizer, self.ready, self._chat_template)
        for engine in self.engines:
            engine.start_tasks(nursery, self._watchdog_timeout)

    @property
    def _watchdog_timeout(self) -> float:
        """0 (off) for an in-process engine: a thread cannot be killed, nor stopped alone."""
        return 0.0 if self.config.in_process else self.config.watchdog_timeout

    def _tokenizer_path(self) -> str:
        return self.config.tokenizer or self.config.engine.worker.model

    def _on_engine_death(self, engine: EngineClient, error: RemoteError) -> None:
        """Start the engine again if the bounds allow, its open requests paused to resume on
        it; otherwise fail them (one pass). Once no engine is left or coming back, all fail."""
        dead = EngineDeadError(error)
        self.engine_errors[engine.index] = dead
        self._router.engine_died(engine.index)
        if not self._shutting_down and self.restarts.allow():
            held = self._suspend(engine.index, dead)
            print(
                f"trillm: {dead}; starting it again (restart {self.restarts.total}, at most "
                f"{self.restarts.max_restarts} within {self.restarts.window:g} s); {held} "
                f"open requests resume on it",
                file=sys.stderr,
                flush=True,
            )
            self._restarting.add(engine.index)
            self._nursery.start_soon(self._restart, engine)
            return
        self._processor.fail_engine(engine.index, dead)
        live = self.live_engines()
        if self._shutting_down:
            pass
        elif live:
            print(f"trillm: {dead}; engines {live} keep serving", file=sys.stderr, flush=True)
        elif self.restarts.max_restarts:
            print(f"trillm: {dead}; not restarted: {self.restarts.describe_refusal()}",
                  file=sys.stderr, flush=True)  # fmt: skip
        self._final_death(dead)

    def _suspend(self, engine: int, dead: EngineDeadError) -> int:
        """Keep `engine`'s open requests for its restart, but fail a poison request
        (`_resume.judge`: the one request at the last two deaths, or a quarantined one that
        killed it alone)."""
        held = [s for s in self._processor.states.values() if s.engine == engine]
        judgement = judge(held, dead.error.step_rnums)
        to_wake = []
        for state in judgement.poison:
            del self._processor.states[state.rnum]
            if state.mailbox.fail(poison_error(dead, state)):
                to_wake.append(state.mailbox)
        for mailbox in to_wake:
            mailbox.wake()
        for state in judgement.poison:
            print(f"trillm: request {state.rnum} was in the engine's batch at {state.deaths} "
                  f"deaths in a row: it fails with the cause, not resumed again",
                  file=sys.stderr, flush=True)  # fmt: skip
        if judgement.quarantined:
            print(f"trillm: {len(judgement.quarantined)} requests shared the engine's batch at "
                  f"its last deaths: each resumes alone among them (quarantine), to find the "
                  f"cause", file=sys.stderr, flush=True)  # fmt: skip
        return len(held) - len(judgement.poison)

    async def _resume(self, engine: EngineClient) -> None:
        """Send the restarted engine every request it held (`_resume.resend`), the
        quarantined ones one at a time, each after the last ended."""
        for state in [s for s in self._processor.states.values() if s.engine == engine.index]:
            if not state.quarantined:
                await resend(engine, state)
        self._nursery.start_soon(release_quarantined, engine, self._processor)

    def _final_death(self, dead: EngineDeadError) -> None:
        if not self.live_engines() and not self._restarting and self._dead is None:
            self._dead = dead
            self._died.set()
            self._engine_back.set()  # waiters see the death

    async def _restart(self, old: EngineClient) -> None:
        """Release the dead engine (process reaped, rings closed), start a new one, serve."""
        await old.shutdown(0)
        engine = EngineClient(
            old.index,
            old.name,
            old.config,
            self._processor,
            self._on_engine_death,
            in_process=old.in_process,
        )
        self.engines[old.index] = engine
        started = time.monotonic()
        try:
            engine.spawn(self._nursery)
            await engine.wait_ready(self.config.start_timeout, self._watchdog_timeout)
        except EngineStartError as exc:  # dying while starting: never again, in a loop
            print(f"trillm: the restarted {engine.name} failed to start: {exc}", file=sys.stderr,
                  flush=True)  # fmt: skip
            engine.dead = True
            self._restarting.discard(old.index)
            self.engine_errors[old.index] = EngineDeadError(exc.error)
            self._processor.fail_engine(old.index, self.engine_errors[old.index])
            self._final_death(self.engine_errors[old.index])
            return
        engine.start_tasks(self._nursery, self._watchdog_timeout)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self._resume(engine)  # if it died meanwhile, its death is being handled
        self._router.alive[old.index] = True
        self.engine_errors.pop(old.index, None)
        self._restarting.discard(old.index)
        print(
            f"trillm: {engine.name} restarted in {time.monotonic() - started:.1f} s; serving",
            file=sys.stderr,
            flush=True,
        )
        back, self._engine_back = self._engine_back, trio.Event()
        back.set()

    async def _shutdown(self) -> None:
        """Drain every engine (bounded, together), then make sure they are gone."""
        self._shutting_down = True
        self._restarting.clear()
        async with trio.open_nursery() as nursery:
            for engine in self.engines:
                if hasattr(engine, "process"):
                    nursery.start_soon(engine.shutdown, self.config.shutdown_timeout)


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
                with trio.CancelScope(shield=True):
                    await llm._shutdown()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # one error (ours or the caller's): raise it as is
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from group.exceptions[0].__cause__
        raise
