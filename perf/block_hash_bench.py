"""Per-block cost of the prefix cache's block hashes: sha256 chains against Python's `hash()`.

The baseline is what the KV-cache manager did before issue 25 (`hash((parent, *tokens))`
per block, root 0), run in the same process on the same tokens; the candidate is
`engine.core._block_hash.hash_blocks` (int32 tokens, sha256, a random 32-byte root). Both
hash a prompt's blocks in one call, as `KVCacheManager._hash_blocks` does. Medians of rounds.

    .venv/bin/python perf/block_hash_bench.py [--blocks 10000] [--block-size 16] [--rounds 9]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence

from trillm.engine.core.kv._block_hash import hash_blocks


def python_hash_blocks(tokens: Sequence[int], block_size: int) -> list[int]:
    parent, hashes = 0, []
    for i in range(len(tokens) // block_size):
        parent = hash((parent, *tokens[i * block_size : (i + 1) * block_size]))
        hashes.append(parent)
    return hashes


def median_us_per_block(run: Callable[[], object], num_blocks: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) / num_blocks * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(49152) for _ in range(args.blocks * args.block_size)]
    root = os.urandom(32)
    baseline = median_us_per_block(
        lambda: python_hash_blocks(tokens, args.block_size), args.blocks, args.rounds
    )
    sha = median_us_per_block(
        lambda: hash_blocks(root, tokens, args.block_size), args.blocks, args.rounds
    )
    print(f"{args.blocks} blocks of {args.block_size} tokens, median of {args.rounds} rounds")
    print(f"  hash() chain   {baseline:6.3f} us/block")
    print(f"  sha256 chain   {sha:6.3f} us/block  ({sha / baseline:.2f}x)")


if __name__ == "__main__":
    main()
