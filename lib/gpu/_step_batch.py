"""The device contract: what the scheduler decided for one step, and what the runner returns.

`StepBatch` is DESIGN.md's SchedulerOutput: new requests (prompt tokens, blocks, sampling
options), running requests (new block ids, computed counts), the tokens scheduled per request
this step, and the requests that finished. `RunnerOutput` is columnar: one row per request
that produced a token. Both have a msgpack codec with raw little-endian arrays, built once
(`StepBatchCodec`), for the executor -> worker broadcast ring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import numpy as np

from ..common.wire import SamplingOptions


class NewRequest(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A request the runner has not seen (or sees again after preemption)."""

    rnum: int
    prompt_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is already in the blocks (prefix-cache hits)
    options: SamplingOptions = SamplingOptions()
    output_token_ids: list[int] = []  # tokens generated before a preemption
    # The prompt as embeddings, float32 little-endian [prompt tokens, hidden] (b"": none):
    # they replace the token embedding of each prompt position (`_prompt_embeds`).
    prompt_embeds: bytes = b""
    # The LoRA adapter of the request (0: the base model); the runner puts it in a slot.
    lora_id: int = 0


@dataclass
class StepBatch:
    """One engine step's schedule. Arrays are numpy; lists hold rare per-request data."""

    step: int
    new_requests: list[NewRequest] = field(default_factory=list)
    cached_rnums: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    cached_new_block_ids: list[list[int]] = field(default_factory=list)
    cached_num_computed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    scheduled_rnums: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    num_scheduled_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    finished_rnums: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    # Structured outputs: the sampling rows whose logits a grammar masks this step, and (at
    # TP > 1, where it rides in the broadcast) their bitmask: int32 [rows, ceil(vocab / 32)],
    # bit t % 32 of word t // 32 set where token t is allowed. At TP 1 the bitmask comes
    # from `execute`'s `masks` instead, computed while the forward runs.
    grammar_rnums: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    grammar_bitmask: np.ndarray | None = None
    # Speculative decoding: the draft tokens each scheduled row verifies this step (counted
    # in its `num_scheduled_tokens`, after its first token), row i's at
    # draft_token_ids[draft_offsets[i]:draft_offsets[i + 1]] (both empty: no drafts); and how
    # many drafts the runner proposes after sampling, for the next step (0: none). A grammar
    # row with drafts has one bitmask row per position it samples (drafts + 1), in order.
    draft_offsets: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    draft_token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    num_speculative_tokens: int = 0

    @property
    def total_num_scheduled_tokens(self) -> int:
        return int(self.num_scheduled_tokens.sum())


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens 1..n-1 given their prefix, for `echo` (one chunk's worth)."""

    first_position: int  # prompt position of the first token these rows score
    logprobs: np.ndarray  # [n] float32
    topk_ids: np.ndarray | None  # [n, k] int32
    topk_logprobs: np.ndarray | None  # [n, k] float32


@dataclass
class RunnerOutput:
    """Sampled tokens of one step, one row per request that produced a token."""

    rnums: np.ndarray  # [n] uint64
    token_ids: np.ndarray  # [n] int32
    logprobs: np.ndarray | None = None  # [n] float32, the sampled token's
    topk_ids: np.ndarray | None = None  # [n, k] int32
    topk_logprobs: np.ndarray | None = None  # [n, k] float32
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)
    # Pooling requests whose prompt ended this step: one contiguous float32 block, a row per
    # request (ALL pooling: a row per prompt token, consecutive), and each row's request.
    pooled_rnums: np.ndarray | None = None  # [m] uint64
    pooled: np.ndarray | None = None  # [m, hidden] float32
    # Speculative decoding: row i's tokens are token_ids[token_offsets[i]:token_offsets[i+1]]
    # (its accepted drafts, then the token sampled after them; None: one token per row), and
    # its draft tokens proposed for the next step, likewise by `draft_offsets` (None: none).
    token_offsets: np.ndarray | None = None  # [n + 1] int32
    draft_offsets: np.ndarray | None = None  # [n + 1] int32
    draft_token_ids: np.ndarray | None = None  # int32
    # Requests that failed alone this step (rnum -> why: their LoRA adapter could not be
    # read again); the engine ends them with that error and drops their tokens.
    failed: dict[int, str] = field(default_factory=dict)


class _WireStep(msgspec.Struct, array_like=True, gc=False):
    step: int
    new_requests: list[NewRequest]
    cached_rnums: bytes
    cached_new_block_ids: list[list[int]]
    cached_num_computed: bytes
    scheduled_rnums: bytes
    num_scheduled_tokens: bytes
    finished_rnums: bytes
    grammar_rnums: bytes = b""
    grammar_words: int = 0
    grammar_bitmask: bytes = b""
    draft_offsets: bytes = b""
    draft_token_ids: bytes = b""
    num_speculative_tokens: int = 0


class StepBatchCodec:
    """Encodes a `StepBatch` into msgpack with raw arrays; decoder and encoder made once."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(_WireStep)

    def encode_into(self, batch: StepBatch, buffer: bytearray) -> None:
        wire = _WireStep(
            batch.step,
            batch.new_requests,
            batch.cached_rnums.astype("<u8", copy=False).tobytes(),
            batch.cached_new_block_ids,
            batch.cached_num_computed.astype("<i4", copy=False).tobytes(),
            batch.scheduled_rnums.astype("<u8", copy=False).tobytes(),
            batch.num_scheduled_tokens.astype("<i4", copy=False).tobytes(),
            batch.finished_rnums.astype("<u8", copy=False).tobytes(),
        )
        if len(batch.draft_offsets):
            wire.draft_offsets = batch.draft_offsets.astype("<i4", copy=False).tobytes()
            wire.draft_token_ids = batch.draft_token_ids.astype("<i4", copy=False).tobytes()
        wire.num_speculative_tokens = batch.num_speculative_tokens
        if len(batch.grammar_rnums):
            if batch.grammar_bitmask is None:
                raise ValueError(
                    "a StepBatch with grammar rows needs its grammar_bitmask to travel"
                )
            wire.grammar_rnums = batch.grammar_rnums.astype("<u8", copy=False).tobytes()
            wire.grammar_words = int(batch.grammar_bitmask.shape[1])
            wire.grammar_bitmask = np.ascontiguousarray(batch.grammar_bitmask, "<i4").tobytes()
        self._encoder.encode_into(wire, buffer)

    def decode(self, data: bytes | memoryview) -> StepBatch:
        wire = self._decoder.decode(data)
        return StepBatch(
            wire.step,
            wire.new_requests,
            np.frombuffer(wire.cached_rnums, "<u8"),
            wire.cached_new_block_ids,
            np.frombuffer(wire.cached_num_computed, "<i4"),
            np.frombuffer(wire.scheduled_rnums, "<u8"),
            np.frombuffer(wire.num_scheduled_tokens, "<i4"),
            np.frombuffer(wire.finished_rnums, "<u8"),
            np.frombuffer(wire.grammar_rnums, "<u8"),
            np.frombuffer(wire.grammar_bitmask, "<i4").reshape(-1, wire.grammar_words)
            if wire.grammar_words
            else None,
            np.frombuffer(wire.draft_offsets, "<i4"),
            np.frombuffer(wire.draft_token_ids, "<i4"),
            wire.num_speculative_tokens,
        )


class _WirePromptLogprobs(msgspec.Struct, array_like=True, gc=False):
    rnum: int
    first_position: int
    k: int
    logprobs: bytes
    topk_ids: bytes | None
    topk_logprobs: bytes | None


class _WireOutput(msgspec.Struct, array_like=True, gc=False):
    rnums: bytes
    token_ids: bytes
    k: int  # top-k columns (0: none)
    logprobs: bytes | None
    topk_ids: bytes | None
    topk_logprobs: bytes | None
    prompt_logprobs: list[_WirePromptLogprobs]
    pooled_rnums: bytes | None = None
    pooled_dim: int = 0
    pooled: bytes | None = None
    token_offsets: bytes | None = None
    draft_offsets: bytes | None = None
    draft_token_ids: bytes | None = None
    failed: dict[int, str] | None = None


def _raw(array: np.ndarray | None, dtype: str) -> bytes | None:
    return None if array is None else np.ascontiguousarray(array, dtype).tobytes()


def _array(data: bytes | None, dtype: str, k: int = 0) -> np.ndarray | None:
    if data is None:
        return None
    array = np.frombuffer(data, dtype)
    return array.reshape(-1, k) if k else array


class RunnerOutputCodec:
    """msgpack with raw arrays for `RunnerOutput` (worker rank 0 -> executor)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(_WireOutput)

    def encode_into(self, output: RunnerOutput, buffer: bytearray) -> None:
        k = 0 if output.topk_ids is None else int(output.topk_ids.shape[1])
        prompt = [
            _WirePromptLogprobs(
                rnum,
                p.first_position,
                0 if p.topk_ids is None else int(p.topk_ids.shape[1]),
                np.ascontiguousarray(p.logprobs, "<f4").tobytes(),
                _raw(p.topk_ids, "<i4"),
                _raw(p.topk_logprobs, "<f4"),
            )
            for rnum, p in output.prompt_logprobs.items()
        ]
        wire = _WireOutput(
            np.ascontiguousarray(output.rnums, "<u8").tobytes(),
            np.ascontiguousarray(output.token_ids, "<i4").tobytes(),
            k,
            _raw(output.logprobs, "<f4"),
            _raw(output.topk_ids, "<i4"),
            _raw(output.topk_logprobs, "<f4"),
            prompt,
        )
        if output.pooled is not None:
            wire.pooled_rnums = _raw(output.pooled_rnums, "<u8")
            wire.pooled_dim = int(output.pooled.shape[1])
            wire.pooled = _raw(output.pooled, "<f4")
        wire.token_offsets = _raw(output.token_offsets, "<i4")
        wire.draft_offsets = _raw(output.draft_offsets, "<i4")
        wire.draft_token_ids = _raw(output.draft_token_ids, "<i4")
        wire.failed = output.failed or None
        self._encoder.encode_into(wire, buffer)

    def decode(self, data: bytes | memoryview) -> RunnerOutput:
        wire = self._decoder.decode(data)
        prompt = {}
        for p in wire.prompt_logprobs:
            prompt[p.rnum] = PromptLogprobs(
                p.first_position,
                np.frombuffer(p.logprobs, "<f4"),
                _array(p.topk_ids, "<i4", p.k),
                _array(p.topk_logprobs, "<f4", p.k),
            )
        return RunnerOutput(
            np.frombuffer(wire.rnums, "<u8"),
            np.frombuffer(wire.token_ids, "<i4"),
            _array(wire.logprobs, "<f4"),
            _array(wire.topk_ids, "<i4", wire.k),
            _array(wire.topk_logprobs, "<f4", wire.k),
            prompt,
            _array(wire.pooled_rnums, "<u8"),
            _array(wire.pooled, "<f4", wire.pooled_dim),
            _array(wire.token_offsets, "<i4"),
            _array(wire.draft_offsets, "<i4"),
            _array(wire.draft_token_ids, "<i4"),
            wire.failed or {},
        )
