"""The engine's request inbox: the request ring's records decoded into scheduler calls.

`EngineCore`'s reader side of the ring, apart from the busy loop (`_engine_core`) so that each
reads alone: an ADD becomes a `Request` (one the scheduler refuses is an ERROR row, never the
engine's end; one with a grammar waits while it compiles), ABORT and SHUTDOWN (a drain, or an
abort of everything) act on the scheduler, a UTILITY call goes to `_control`. The loop owns
the state these read and write; `RequestInbox` names it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import msgspec
import numpy as np

from ...transport_shm import BusyError, RingReader
from ..protocol import _messages as P
from ..protocol._config import EngineConfig
from ._control import Controls
from ._grammar import Grammars, load_ll_tokenizer
from ._lora_registry import LoraRegistry
from .executor._executor import Executor
from .sched._request import Request, RequestStatus
from .sched._scheduler import InvalidRequestError, Scheduler

IDLE_POLL_S = 1.0
GRAMMAR_POLL_S = 0.002  # the longest nap on the ring while a grammar compiles or a LoRA loads


class RequestInbox:
    """The request ring's reader side of `EngineCore`: records in, scheduler calls out."""

    # Set by `EngineCore` (`__init__`, `start`), which owns them; read and written here.
    config: EngineConfig
    requests: RingReader
    executor: Executor
    scheduler: Scheduler
    loras: LoraRegistry
    controls: Controls
    eos_token_id: int | None
    is_paused: bool
    sleep_level: int
    _add_decoder: msgspec.msgpack.Decoder[P.AddHeader]
    _utility_decoder: msgspec.msgpack.Decoder[P.UtilityCall]
    _shutdown_decoder: msgspec.msgpack.Decoder[P.Shutdown]
    _draining_until: float | None
    _needs_flush: bool
    _rejected: list[int]
    _grammars: Grammars | None
    _send_event: Callable[[P.Event], None]

    # -- the request ring ----------------------------------------------------------------

    def _drain_requests(self, *, block: bool, timeout: float = IDLE_POLL_S) -> None:
        reader = self.requests
        if block:
            try:
                reader.peek(timeout=timeout)
            except BusyError:
                self.executor.check_health()
                return
        while (record := reader.try_peek()) is not None:
            kind, payload = record
            try:
                self._handle(kind, payload)
            finally:
                reader.release()

    def _handle(self, kind: int, payload: memoryview) -> None:
        if kind == P.ADD:
            header, tokens = P.unpack_add(payload, self._add_decoder)
            ids = tokens.tolist()
            num_prompt = len(ids) - header.num_output_tokens
            request = Request(
                rnum=header.rnum,
                prompt_token_ids=ids[:num_prompt],
                output_token_ids=ids[num_prompt:],
                options=header.options,
                max_tokens=header.max_tokens,
                eos_token_id=self.eos_token_id,
                arrival_time=header.arrival_time,
                cache_salt=header.cache_salt,
                prompt_embeds=header.prompt_embeds,
            )
            if header.grammar:
                request.status = RequestStatus.WAITING_FOR_GRAMMAR
            try:
                request.lora_id, request.lora_digest = header.lora_id, self._digest(header)
                self.scheduler.add_request(request)
            except InvalidRequestError as exc:  # the frontend validates; never kill the engine
                self._rejected.append(header.rnum)
                self._send_event(P.RequestError(header.rnum, str(exc)))
                self._needs_flush = True
                return
            if header.grammar:
                self._grammars_for_requests().submit(header.rnum, header.grammar)
            if self._draining_until is not None:  # draining admits nothing new
                self.abort([header.rnum])
        elif kind == P.ABORT:
            self.abort(np.frombuffer(payload, "<u8").tolist())
        elif kind == P.UTILITY:
            try:
                call = self._utility_decoder.decode(payload)
            except msgspec.DecodeError as exc:  # no call id to answer: say so, serve on
                print(f"trillm engine: an unreadable control call: {exc}", file=sys.stderr)
                return
            self.controls.call(call)
        elif kind == P.SHUTDOWN:
            shutdown = self._shutdown_decoder.decode(payload)
            self.is_paused = False  # a drain steps what is left
            if shutdown.mode == "abort" or self.sleep_level:  # asleep, nothing can step
                self._abort_all()
                self._draining_until = time.monotonic()
            else:
                self._draining_until = time.monotonic() + max(0.0, shutdown.timeout)
        else:
            raise ValueError(f"unknown request-ring record kind {kind}")

    def _digest(self, header: P.AddHeader) -> bytes:
        try:
            return self.loras.digest_of(header.lora_id)
        except KeyError:
            raise InvalidRequestError(
                f"LoRA adapter id {header.lora_id} is not loaded (unloaded meanwhile?)"
            ) from None

    def abort(self, rnums: list[int]) -> None:
        if self._grammars is not None:
            for rnum in rnums:
                self._grammars.cancel(rnum)
        if self.scheduler.abort_requests(rnums):
            self._needs_flush = True

    def _abort_all(self) -> None:
        self.abort(self.scheduler.unfinished_rnums())

    # -- structured outputs ----------------------------------------------------------------

    def _grammars_for_requests(self) -> Grammars:
        if self._grammars is None:
            model = self.executor.model_config
            path = self.config.tokenizer or self.config.worker.model
            vocab, eos = model.vocab_size, list(model.eos_token_ids)
            self._grammars = Grammars(
                lambda: load_ll_tokenizer(path, vocab, eos),
                vocab,
                timeout=self.config.structured_outputs_timeout,
            )
        return self._grammars

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar compiled; fail those whose compile failed."""
        if self._grammars is None or not self._grammars.num_pending:
            return
        ready, failed = self._grammars.poll()
        for rnum, state in ready:
            self.scheduler.grammar_ready(rnum, state)
        for rnum, message in failed:
            if self.scheduler.grammar_failed(rnum):
                print(f"trillm engine: request {rnum} failed: {message}", file=sys.stderr)
                self._rejected.append(rnum)
                self._send_event(P.RequestError(rnum, message))
                self._needs_flush = True
