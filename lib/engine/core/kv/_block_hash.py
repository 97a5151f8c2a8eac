"""Prefix-cache block hashes: sha256, chained from a random root (vLLM's scheme).

A full block is named by `sha256(parent || len(extra) || extra || token_ids)`: its parent's
32-byte digest (the previous block's hash, or the root for a request's first block), the
length (u32, little-endian) and bytes of `extra` (what besides the tokens decides the block's
KV: the request's cache salt, in its first block only, and a LoRA adapter's identity, once
adapters exist), and the block's token ids as int32 little-endian. Every part has a fixed or
stated length, so different inputs never concatenate to the same bytes, and a hash names its
whole prefix.

Why not Python's `hash()` (what this replaced): integers and tuples hash the same in every
process whatever PYTHONHASHSEED says, and 64 bits are few, so two prompts with the same
hash could be crafted offline and one tenant's request served another's KV (vLLM's advisory
GHSA-rm76-4mrf-v9r8). The root comes from `os.urandom`, drawn by each KV-cache manager (one
per engine process), so no hash can be predicted outside the process either.

Cost (`perf/block_hash_bench.py`): 0.9-1.3 us per block of 16 tokens, 1.2-2x the `hash()`
chain, once per block (a request keeps its hashes); converting the tokens to bytes, once per
call, is about a third of it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import numpy as np

HASH_BYTES = 32  # sha256's digest


def new_root_hash() -> bytes:
    """A fresh random parent for first blocks; hashes from different roots never match."""
    return os.urandom(HASH_BYTES)


def hash_block_tokens(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """The hash of one block: its tokens after the prefix named `parent`, with `extra`."""
    data = np.asarray(token_ids, dtype="<i4").tobytes()
    return hashlib.sha256(parent + len(extra).to_bytes(4, "little") + extra + data).digest()


def hash_blocks(
    parent: bytes, token_ids: Sequence[int], block_size: int, extra: bytes = b""
) -> list[bytes]:
    """The chained hashes of the full blocks of `token_ids` (a partial last block has none).

    Args:
        parent: the hash of the prefix before `token_ids` (the root for a prompt's start).
        token_ids: the tokens, from a block boundary.
        block_size: tokens per block.
        extra: mixed into every block (a cache salt, an adapter's identity).
    """
    num_blocks = len(token_ids) // block_size
    data = np.asarray(token_ids[: num_blocks * block_size], dtype="<i4").tobytes()
    header = len(extra).to_bytes(4, "little") + extra
    step, sha256, hashes = 4 * block_size, hashlib.sha256, []
    for start in range(0, len(data), step):
        parent = sha256(parent + header + data[start : start + step]).digest()
        hashes.append(parent)
    return hashes
