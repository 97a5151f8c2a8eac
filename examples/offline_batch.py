"""Complete 100 prompts in one offline batch on the built-in SmolLM2-135M-Instruct with
`trillm.LLM` (synchronous, shaped like `vllm.LLM`), then print a summary.

.venv/bin/python examples/offline_batch.py [--max-tokens 12]
"""

from __future__ import annotations

import argparse
import time

import trillm

COUNTRIES = ["France", "Germany", "Italy", "Spain", "Japan", "Canada", "Egypt", "Peru",
             "Kenya", "Norway"]  # fmt: skip
TEMPLATES = [
    "The capital of {} is",
    "The official language of {} is",
    "A famous dish from {} is",
    "The currency of {} is",
    "The largest city in {} is",
    "{} is a country in",
    "The flag of {} has the colours",
    "A popular sport in {} is",
    "The population of {} is about",
    "A well-known landmark in {} is",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=12)
    args = parser.parse_args()
    prompts = [t.format(c) for t in TEMPLATES for c in COUNTRIES]
    params = trillm.SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    started = time.monotonic()
    with trillm.LLM() as llm:  # the built-in default model, as `trillm serve`
        loaded = time.monotonic()
        results = llm.generate(prompts, params)
        finished = time.monotonic()
    for result in results[:: len(COUNTRIES) + 1]:  # a sample, one per template
        print(f"{result.prompt!r} -> {result.outputs[0].text!r}")
    in_order = all(r.prompt == p for r, p in zip(results, prompts, strict=True))
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in results)
    seconds = finished - loaded
    print(
        f"{len(results)} prompts, results in order: {in_order}; {prompt_tokens} prompt tokens, "
        f"{generated} generated in {seconds:.1f} s ({generated / seconds:.0f} tokens/s; "
        f"start-up {loaded - started:.1f} s)"
    )


if __name__ == "__main__":
    main()
