"""A request checked once, before anything is sent: what `AsyncLLM.prepare` returns."""

from __future__ import annotations

from dataclasses import dataclass

from ._sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A prompt's token ids (in the vocabulary), its sampling parameters, its max_tokens (the
    model's length checked), its constraint's compiled grammar ("" for none) and the engine
    it is pinned to, if any (in range).

    Made by `AsyncLLM.prepare`, which checks each part; `generate` trusts it and checks
    nothing again (before, a server request was tokenised and checked twice).
    """

    token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    grammar: str = ""
    data_parallel_rank: int | None = None  # the engine it is pinned to (None: the router's)
    # A prompt sent as embeddings: float32 [len(token_ids), hidden] bytes (`_prompt_embeds`);
    # `token_ids` are then placeholders (0), one per row.
    prompt_embeds: bytes = b""
    lora_id: int = 0  # the LoRA adapter's engine id (0: the base model)
