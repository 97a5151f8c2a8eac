"""How far `--quantization gguf` logits are from the dequantised model's, on SmolLM2's Q4_1 file.

The built-in GGUF loaded twice (`none`: dequantised to float32; `gguf`: the blocks kept, in C
tiles where they build), the test prompts of `tests/gpu/test_smollm2.py` as chat turns, N
greedy tokens each; prints the largest |logit difference| over every step until a prompt's
greedy tokens part, and where they part.

    python perf/quant_logits.py [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.gpu.conftest import make_runner
from tests.gpu.test_quantized import chat_prompts, greedy_and_logits
from trillm.default_model import find_default_gguf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    gguf = find_default_gguf()
    prompts = chat_prompts()
    kw = dict(num_blocks=512, block_size=16, max_num_seqs=16)
    runs = {}
    for setting in ("none", "gguf"):
        runner = make_runner(gguf, quantization=setting, **kw)
        runs[setting] = greedy_and_logits(runner, prompts, args.new_tokens)
    (dense_tokens, dense_logits), (tokens, logits) = runs["none"], runs["gguf"]
    worst, parted = 0.0, {}
    for step, (ref, ours) in enumerate(zip(dense_logits, logits, strict=True)):
        for row in range(len(prompts)):
            if row in parted:
                continue
            worst = max(worst, (ours[row] - ref[row]).abs().max().item())
            if tokens[row][step] != dense_tokens[row][step]:
                parted[row] = step
    print(
        f"{len(prompts)} prompts x {args.new_tokens} greedy tokens: largest |logit difference| "
        f"{worst:.4g} before parting; parted (prompt: step): {parted or 'none'}"
    )


if __name__ == "__main__":
    main()
