"""Applying a grammar's token bitmask to a step's logits, before sampling.

The bitmask (from the engine's grammars, `engine.core._grammar`) has one int32 row per masked
request, bit `t % 32` of word `t // 32` set where token `t` is allowed. Disallowed logits
become -inf, so every later stage (penalties, temperature, top-k/p, greedy argmax) can only
pick an allowed token, and the reported logprobs are those of the constrained distribution.
"""

from __future__ import annotations

import numpy as np
import torch


def apply_grammar_bitmask(
    logits: torch.Tensor, rnums: np.ndarray, grammar_rnums: np.ndarray, bitmask: np.ndarray
) -> None:
    """Mask, in place, the rows of `logits` (one per entry of `rnums`) named in
    `grammar_rnums`, with `bitmask`'s rows in the same order as `grammar_rnums`."""
    row_of = {rnum: i for i, rnum in enumerate(rnums.tolist())}
    rows = [row_of[rnum] for rnum in grammar_rnums.tolist()]
    vocab = logits.shape[1]
    bits = np.unpackbits(
        np.ascontiguousarray(bitmask, "<i4").view(np.uint8), axis=1, bitorder="little"
    )
    if bits.shape[1] < vocab:  # ids past the grammar's vocabulary are never allowed
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    allowed = torch.from_numpy(bits[:, :vocab]).to(logits.device, non_blocking=True).bool()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
