"""Per-request sampling options as they cross to the device side.

The engine's user-facing `SamplingParams` validates what users send and converts it to this
wire form (it rides in the scheduler output's new-request section, msgpack, once per
request). Field order is wire ABI: append new fields at the end.
"""

from __future__ import annotations

import msgspec


class SamplingOptions(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """What the sampler needs to know about one request (already validated)."""

    temperature: float = 1.0  # 0 means greedy (exact argmax)
    top_p: float = 1.0  # 1 means off
    top_k: int = 0  # 0 means off
    min_p: float = 0.0  # 0 means off
    presence_penalty: float = 0.0  # on output tokens
    frequency_penalty: float = 0.0  # on output tokens
    repetition_penalty: float = 1.0  # on prompt and output tokens; 1 means off
    seed: int | None = None  # own generator: same tokens whatever else is in the batch
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many were generated
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # (the engine stops on EOS; the sampler only masks it, above)
    logprobs: int | None = None  # None: none; k >= 0: sampled token's logprob and top k
    prompt_logprobs: int | None = None  # None: none; k >= 0: per prompt position, top k

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
