"""Structured outputs in the engine: one llguidance matcher per request, compiled off the busy
loop, and each step's token mask computed while the forward pass runs.

- **Compiling** runs in a thread pool: llguidance drops the GIL while it builds a grammar, so
  the busy loop steps the other requests meanwhile; the request waits in a state of its own
  (`RequestStatus.WAITING_FOR_GRAMMAR`, held by the scheduler outside its queues). A compile
  that fails or outlives its deadline fails that request alone. Compiled grammars are kept by
  text (LRU), and each request gets a cheap `deep_copy` of one: n > 1 compiles once.
- **Masks**: `start_masks` hands the step's matchers to a thread that fills one bitmask row
  each (llguidance's `LLExecutor`, in parallel, GIL dropped) while the caller runs the
  forward; the runner waits for it just before sampling and applies it on the device.
- **State** advances by one `accept` per sampled token, in `update_from_output`; preemption
  keeps it (the outputs it has seen are kept too), so a recomputed request resumes exactly.

Why llguidance (docs/design.md): no dependencies, a compile step of milliseconds where
xgrammar's takes seconds for large tool sets, and masks computed lazily per step.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...common.threads import start_thread

MAX_COMPILED = 256  # compiled grammars kept for reuse, by text


def compile_stack_bytes(grammar: str) -> int:
    """The stack a compile of `grammar` gets: llguidance recurses once per link of a rule
    chain, and the frontend admitted what a stack of 1 KiB per byte survives (its check runs
    on one, `client._grammar_budget`); the engine gives its compile the same, at least 8 MiB."""
    return min(max(8 << 20, 1024 * len(grammar)), 1 << 30)


class GrammarState:
    """One request's position in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher  # llguidance.LLMatcher

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token. Returns whether the grammar is now complete (no
        token but EOS may follow: the request is done). A token outside the grammar (the
        mask forbids it, so only a bug sends one) raises `GrammarViolationError`."""
        if not self.matcher.consume_token(token_id):
            raise GrammarViolationError(
                f"token {token_id} is not allowed by the grammar: {self.matcher.get_error()}"
            )
        return bool(self.matcher.is_stopped())


class GrammarViolationError(RuntimeError):
    """A sampled token broke its request's grammar (the mask was not applied)."""


class Grammars:
    """Compiles grammars for requests and computes the batch's token masks.

    Args:
        tokenizer: the model's llguidance tokenizer (`llguidance.LLTokenizer`), or a
            callable that builds it (at once, in a thread of its own).
        timeout: seconds a compile may take before its request fails.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *, timeout: float) -> None:
        import llguidance

        self.timeout = timeout
        self.words = (vocab_size + 31) // 32
        threads = max(1, min(4, os.cpu_count() or 1))
        # Compiles run in daemon threads, `threads` at a time: one past its deadline is
        # abandoned, and must not hold the process at exit as a pool's thread would.
        self._slots = threading.BoundedSemaphore(threads)
        self._ready_at = time.monotonic()
        self._ll_tokenizer: Any = None if callable(tokenizer) else tokenizer
        # A callable is built at once, in a thread of its own (about a second), and the
        # compile deadlines count from when it is ready: the first request must not pay it.
        self._tokenizer_ready = threading.Event()
        self._tokenizer_error: BaseException | None = None
        if callable(tokenizer):
            threading.Thread(
                target=self._build, args=(tokenizer,), name="trillm-ll-tokenizer", daemon=True
            ).start()
        else:
            self._tokenizer_ready.set()
        self._masker = concurrent.futures.ThreadPoolExecutor(1, "trillm-mask")
        self._ll_executor = llguidance.LLExecutor(threads)
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._compiling: dict[str, concurrent.futures.Future[Any]] = {}  # grammar -> its compile
        self._pending: dict[int, tuple[concurrent.futures.Future[Any], str, float]] = {}
        self._bitmask = np.empty((0, self.words), np.int32)

    # -- compiling -----------------------------------------------------------------------

    def submit(self, rnum: int, grammar: str) -> None:
        """Start compiling `grammar` for request `rnum` (`poll` says when it is ready)."""
        template = self._compiled.get(grammar)
        future: concurrent.futures.Future[Any] | None = self._compiling.get(grammar)
        if template is not None:
            self._compiled.move_to_end(grammar)
            future = concurrent.futures.Future()
            future.set_result(template)
        elif future is None:  # not compiled, nor compiling for another request (n > 1)
            future = self._compiling[grammar] = concurrent.futures.Future()  # until polled
            start_thread(
                functools.partial(self._compile_into, grammar, future),
                compile_stack_bytes(grammar),
                "trillm-grammar",
            )
        self._pending[rnum] = (future, grammar, time.monotonic())

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def cancel(self, rnum: int) -> None:
        """Forget a pending compile (the request was aborted); the thread finishes unseen."""
        self._pending.pop(rnum, None)

    def poll(self) -> tuple[list[tuple[int, GrammarState]], list[tuple[int, str]]]:
        """Requests whose compile ended: (rnum, state) for each ready one, (rnum, message) for
        each that failed or ran past the timeout. Never blocks."""
        ready: list[tuple[int, GrammarState]] = []
        failed: list[tuple[int, str]] = []
        now = time.monotonic()
        ready_at = self._ready_at if self._tokenizer_ready.is_set() else None
        for rnum, (future, grammar, submitted) in list(self._pending.items()):
            if future.done():
                del self._pending[rnum]
                self._compiling.pop(grammar, None)
                try:
                    template = future.result()
                except GrammarCompileError as exc:
                    failed.append((rnum, str(exc)))
                    continue
                except Exception as exc:  # a tokenizer that would not load, ...
                    failed.append((rnum, f"the grammar could not be compiled: {exc!r}"))
                    continue
                self._remember(grammar, template)
                ready.append((rnum, GrammarState(template.deep_copy())))
            elif ready_at is not None and now >= max(submitted, ready_at) + self.timeout:
                del self._pending[rnum]
                failed.append(
                    (
                        rnum,
                        f"compiling the grammar took longer than {self.timeout:g} s "
                        "(--structured-outputs-timeout); simplify it",
                    )
                )
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Sleep until some pending compile ends, or `timeout` seconds."""
        futures = [future for future, _, _ in self._pending.values()]
        if futures:
            concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def _compile_into(self, grammar: str, future: concurrent.futures.Future[Any]) -> None:
        with self._slots:
            try:
                future.set_result(self._compile(grammar))
            except BaseException as exc:  # the poller reports it, as the request's error
                future.set_exception(exc)

    def _build(self, build: Callable[[], Any]) -> None:
        try:
            self._ll_tokenizer = build()
        except BaseException as exc:  # every compile reports it
            self._tokenizer_error = exc
        finally:
            self._ready_at = time.monotonic()
            self._tokenizer_ready.set()

    def _compile(self, grammar: str) -> Any:
        import llguidance

        self._tokenizer_ready.wait()
        if self._tokenizer_error is not None:
            raise GrammarCompileError(
                f"the model's tokenizer did not load for grammars: {self._tokenizer_error!r}"
            )
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarCompileError(f"the grammar does not compile: {matcher.get_error()}")
        return matcher

    def _remember(self, grammar: str, template: Any) -> None:
        self._compiled[grammar] = template
        self._compiled.move_to_end(grammar)
        while len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)

    # -- masks ---------------------------------------------------------------------------

    def start_masks(
        self, states: list[GrammarState], drafts: list[list[int]] | None = None
    ) -> Callable[[], np.ndarray] | None:
        """Begin filling one bitmask row per state (row i: bit t of word t // 32 set when
        token t is allowed); returns the wait for it, or None for no states.

        `drafts` (speculative decoding): state i's drafts, which its step verifies: it takes
        a row per position (len + 1), each the mask after the drafts before it (consumed,
        then rolled back; the scheduler validated them)."""
        if not states:
            return None
        per_state = [1] * len(states) if drafts is None else [len(d) + 1 for d in drafts]
        n = sum(per_state)
        if len(self._bitmask) < n:
            self._bitmask = np.empty((max(n, 2 * len(self._bitmask)), self.words), np.int32)
        bitmask = self._bitmask[:n]
        pointer, row_bytes = bitmask.ctypes.data, self.words * 4
        firsts = np.cumsum(per_state) - per_state
        pairs = [
            (s.matcher, int(i)) for s, i, m in zip(states, firsts, per_state, strict=True) if m == 1
        ]
        spec = [
            (s.matcher, int(i), d)
            for s, i, d in zip(states, firsts, drafts or [], strict=False)
            if d
        ]

        def fill() -> None:
            if pairs:
                self._ll_executor.unsafe_compute_mask_ptr(pairs, pointer, row_bytes, n)
            for matcher, first, tokens in spec:
                for j in range(len(tokens) + 1):
                    matcher.unsafe_compute_mask_ptr(pointer + (first + j) * row_bytes, row_bytes)
                    if j < len(tokens):
                        matcher.consume_token(tokens[j])
                matcher.rollback(len(tokens))

        future = self._masker.submit(fill)

        def wait() -> np.ndarray:
            future.result()
            return bitmask

        return wait

    def close(self) -> None:
        self._masker.shutdown(wait=False, cancel_futures=True)


class GrammarCompileError(ValueError):
    """A grammar does not compile; the message is llguidance's."""


def load_ll_tokenizer(path: str, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """llguidance's tokenizer for the model at `path` (a directory with tokenizer.json, or a
    GGUF file), its masks `vocab_size` wide, EOS allowed where a grammar may end."""
    import llguidance

    eos = list(eos_token_ids) or None
    file = Path(path) / "tokenizer.json"
    if file.is_file():
        return llguidance.LLTokenizer(file.read_text(), n_vocab=vocab_size, eos_token=eos)
    import llguidance.hf
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        directory, name = os.path.split(os.path.abspath(path))
        hf = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    else:
        hf = AutoTokenizer.from_pretrained(path)
    return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)  # type: ignore[arg-type]
