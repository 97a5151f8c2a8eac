"""The output pump's per-step work: one pass over a STEP record's columns.

Per row: append the tokens, detokenise incrementally, check stop strings (holding back text
that could still become one), finish, and put the new output into the request's mailbox.
Mailboxes are woken together after the pass. Requests that a stop string ended are returned,
so the caller aborts them in the engine. EVENT records about one request (its prompt
logprobs, its own failure) go through `process_event`. Nothing here waits: the trio pump and
the synchronous client (`_sync_client`) share it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...protocol import _messages as P
from ...protocol._step_record import StepView
from .._errors import RequestFailedError
from ._detokenizer import IncrementalDetokenizer, StopChecker
from ._outputs import FINISH_REASONS, Mailbox, Output, TokenLogprob


@dataclass(slots=True, eq=False)
class RequestState:
    """The frontend's copy of one (child) request: authoritative for its client."""

    rnum: int
    index: int
    mailbox: Mailbox
    detokenizer: IncrementalDetokenizer | None  # None: a pooling request (no text)
    stop: StopChecker | None
    num_prompt_tokens: int
    logprobs: int | None  # top logprobs wanted per token, or None
    prompt_token_ids: list[int] = field(default_factory=list)
    # The request's own stop_token_ids: one of them ending it is its stop_reason, as in vLLM
    # (EOS is no stop reason: None).
    stop_token_ids: frozenset[int] = frozenset()
    num_output_tokens: int = 0
    finished: bool = False
    token_ids: list[int] = field(default_factory=list)
    engine: int = 0  # the data-parallel engine it runs on
    # What resuming it on a restarted engine needs: its options, token budget, grammar, cache
    # salt; how many engine deaths in a row it was in the failing step at, whether it is on
    # the engine now (False while held for a restart or a quarantine turn) and whether it is
    # quarantined (resumed alone among the suspects of a death: `_resume`).
    options: Any = None
    max_tokens: int = 0
    grammar: str = ""
    cache_salt: str = ""
    prompt_embeds: bytes = b""  # a prompt sent as embeddings (its ids are placeholders)
    lora_id: int = 0  # its LoRA adapter's engine id (0: the base model), kept for a resume
    deaths: int = 0
    on_engine: bool = False
    quarantined: bool = False


class OutputProcessor:
    """Fans each STEP record out to the requests it names.

    It owns the frontend's table of open requests (request number -> `RequestState`); the
    others change it only through `add`, `forget` and `fail`, and read it through `get`,
    `of_engine` and `len`, so that one object says which requests are open.
    """

    def __init__(self) -> None:
        self._states: dict[int, RequestState] = {}
        # Tokens generated over this processor's life: `LLM`'s progress bar reads it. The
        # latency series are the server's Prometheus histograms (`http._metrics`), not kept here.
        self.generation_tokens = 0

    def process_step(self, view: StepView) -> list[int]:
        """Apply one STEP record; returns rnums that a stop string finished (to abort)."""
        states = self._states
        offsets = view.tok_offsets.tolist()
        tokens = view.tokens.tolist()
        finish = view.finish.tolist() if view.num_finished else None
        cached = None if view.num_cached_tokens is None else view.num_cached_tokens.tolist()
        pooled = pooled_rows(view)
        to_wake: list[Mailbox] = []
        to_abort: list[int] = []
        for i, rnum in enumerate(view.rnums.tolist()):
            state = states.get(rnum)
            if state is None:  # aborted by us: the engine's last words about it
                continue
            new = tokens[offsets[i] : offsets[i + 1]]
            stopped = False
            fed = state.stop is not None and len(new) > 1  # several tokens (speculative)
            if fed:
                text, new, stopped = _push_until_stop(state, new)
            else:
                text = state.detokenizer.push(new) if new and state.detokenizer is not None else ""
            reason = FINISH_REASONS.get(finish[i]) if finish is not None else None
            if reason is not None and not stopped and state.detokenizer is not None:
                tail = state.detokenizer.flush()  # release a held, incomplete character
                if fed and state.stop is not None:
                    tail, stopped = state.stop.feed(tail)
                text += tail
            stop_reason: str | int | None = None
            if state.stop is not None:
                if not fed:
                    text, stopped = state.stop.feed(text)
                if stopped:
                    if reason is None:
                        to_abort.append(rnum)
                    reason, stop_reason = "stop", state.stop.stop_string
                elif reason is not None:
                    text += state.stop.flush()
            if reason == "stop" and stop_reason is None and new and new[-1] in state.stop_token_ids:
                stop_reason = new[-1]
            output = Output(
                state.index,
                text,
                new,
                reason,
                stop_reason,
                self._logprobs(view, state, offsets[i], len(new))
                if state.logprobs is not None
                else None,
                state.num_prompt_tokens,
                state.num_output_tokens + len(new),
                cached[i] if cached is not None else 0,
            )
            if pooled:
                output.pooled = pooled.get(rnum)
            self._account(state, len(new))
            state.token_ids += new
            if reason is not None:
                state.finished = True
                del states[rnum]
            if state.mailbox.put(output):
                to_wake.append(state.mailbox)
        for mailbox in to_wake:
            mailbox.wake()
        return to_abort

    def _account(self, state: RequestState, num_tokens: int) -> None:
        state.num_output_tokens += num_tokens
        self.generation_tokens += num_tokens

    @staticmethod
    def _logprobs(
        view: StepView, state: RequestState, start: int, count: int
    ) -> list[TokenLogprob]:
        k = min(state.logprobs or 0, view.topk)
        out = []
        for t in range(start, start + count):
            logprob = float(view.logprobs[t]) if view.logprobs is not None else 0.0
            top: list[tuple[int, float]] = []
            if k and view.topk_ids is not None and view.topk_logprobs is not None:
                top = list(
                    zip(
                        view.topk_ids[t, :k].tolist(),
                        view.topk_logprobs[t, :k].tolist(),
                        strict=True,
                    )
                )
            out.append(TokenLogprob(int(view.tokens[t]), logprob, top))
        return out

    def process_event(self, event: P.PromptLogprobsChunk | P.RequestError) -> None:
        """Apply a request's EVENT: a chunk of its prompt logprobs, or its own failure (the
        engine refused it alone). Utility results are the caller's."""
        if isinstance(event, P.PromptLogprobsChunk):
            state = self._states.get(event.rnum)
            if state is not None and state.mailbox.put(prompt_logprobs_output(state, event)):
                state.mailbox.wake()
        else:
            state = self._states.pop(event.rnum, None)
            if state is not None and state.mailbox.fail(RequestFailedError(event.message)):
                state.mailbox.wake()

    # -- the request table -------------------------------------------------------------------

    def add(self, state: RequestState) -> None:
        """Open `state`: the engine's records for its number reach it from now on."""
        self._states[state.rnum] = state

    def forget(self, rnum: int) -> RequestState | None:
        """Close request `rnum` without a word to its mailbox (its caller left); its state."""
        return self._states.pop(rnum, None)

    def get(self, rnum: int) -> RequestState | None:
        return self._states.get(rnum)

    def of_engine(self, engine: int) -> list[RequestState]:
        """The open requests on engine `engine` (its index), oldest first."""
        return [s for s in self._states.values() if s.engine == engine]

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, rnum: object) -> bool:
        return rnum in self._states

    def fail(
        self,
        error: BaseException | Callable[[RequestState], BaseException],
        states: Iterable[RequestState] | None = None,
    ) -> None:
        """Close `states` (None: every open request), each raising `error` (or
        `error(state)`) from its stream: one synchronous pass, then the wake-ups."""
        failed = list(self._states.values()) if states is None else list(states)
        to_wake = []
        for state in failed:
            if self._states.pop(state.rnum, None) is None:
                continue
            if state.mailbox.fail(error(state) if callable(error) else error):
                to_wake.append(state.mailbox)
        for mailbox in to_wake:
            mailbox.wake()


def _push_until_stop(state: RequestState, new: list[int]) -> tuple[str, list[int], bool]:
    """Detokenise a row's tokens one at a time through its stop checker: a stop string that
    ends inside the run drops the tokens after it, as one token a step would never have
    produced them. Returns (text to emit, the tokens kept, whether a stop string ended it)."""
    assert state.stop is not None and state.detokenizer is not None
    text = ""
    for j, token in enumerate(new):
        piece, stopped = state.stop.feed(state.detokenizer.push([token]))
        text += piece
        if stopped:
            return text, new[: j + 1], True
    return text, new, False


def pooled_rows(view: StepView) -> dict[int, np.ndarray]:
    """Each pooling request's rows of the step's pooled block, copied out of the ring (its
    rows are consecutive: several for ALL pooling)."""
    if view.pooled is None or view.pooled_rnums is None or not len(view.pooled_rnums):
        return {}
    rnums = view.pooled_rnums
    starts = np.flatnonzero(np.r_[True, rnums[1:] != rnums[:-1]])
    ends = np.r_[starts[1:], len(rnums)]
    return {
        int(rnums[a]): view.pooled[a:b].copy()
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
    }


def prompt_logprobs_output(state: RequestState, event: P.PromptLogprobsChunk) -> Output:
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
