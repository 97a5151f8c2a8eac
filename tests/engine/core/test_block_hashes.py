"""Prefix-cache block hashes: sha256 chains from a random root per manager (so per process)."""

from __future__ import annotations

import os
import subprocess
import sys

from trillm.engine.core.kv._block_hash import HASH_BYTES, hash_block_tokens, hash_blocks
from trillm.engine.core.kv._kv_cache_manager import KVCacheManager
from trillm.engine.core.sched._request import Request
from trillm.gpu import SamplingOptions

BS = 4

# Prints the root and the first block's hash of a fixed prompt, as one engine would make them.
_PROBE = """
from trillm.engine.core.kv._kv_cache_manager import KVCacheManager
from trillm.engine.core.sched._request import Request
from trillm.gpu import SamplingOptions
kv = KVCacheManager(8, 4)
request = Request(1, [1, 2, 3, 4, 5], SamplingOptions(), max_tokens=1)
kv.get_computed_blocks(request)
print(kv.root_hash.hex(), request.block_hashes[0].hex())
"""


def _hashes(kv: KVCacheManager, prompt: list[int]) -> list[bytes]:
    request = Request(1, prompt, SamplingOptions(), max_tokens=1)
    kv.get_computed_blocks(request)
    return request.block_hashes


def test_two_processes_draw_different_roots() -> None:
    # The same PYTHONHASHSEED in both: Python's hash() would agree, the roots must not.
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    probes = [
        subprocess.Popen([sys.executable, "-c", _PROBE], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        outputs = [probe.communicate(timeout=120)[0] for probe in probes]
    finally:
        for probe in probes:
            probe.kill()
            probe.wait()
    assert [probe.returncode for probe in probes] == [0, 0]
    (root_a, block_a), (root_b, block_b) = (out.split() for out in outputs)
    assert len(bytes.fromhex(root_a)) == len(bytes.fromhex(block_a)) == HASH_BYTES
    assert root_a != root_b
    assert block_a != block_b


def test_two_managers_never_share_a_hash() -> None:
    prompt = list(range(9))
    assert set(_hashes(KVCacheManager(8, BS), prompt)).isdisjoint(
        _hashes(KVCacheManager(8, BS), prompt)
    )


def test_equal_prefixes_hash_equal_and_the_chain_is_the_manager_s() -> None:
    kv = KVCacheManager(8, BS)
    first = _hashes(kv, [*range(8), 100, 101, 102, 103, 0])
    second = _hashes(kv, [*range(8), 200, 201, 202, 203, 0])
    assert len(first) == len(second) == 3  # the last token is never looked up
    assert first[:2] == second[:2]
    assert first[2] != second[2]
    assert first == hash_blocks(kv.root_hash, [*range(8), 100, 101, 102, 103], BS)


def test_each_hash_depends_on_every_earlier_block() -> None:
    root = os.urandom(HASH_BYTES)
    tokens = list(range(16))
    base = hash_blocks(root, tokens, BS)
    assert len(set(base)) == 4
    for position in range(16):
        changed = hash_blocks(root, [*tokens[:position], 999, *tokens[position + 1 :]], BS)
        block = position // BS
        assert changed[:block] == base[:block]
        assert all(c != b for c, b in zip(changed[block:], base[block:], strict=True))


def test_block_order_and_a_partial_block_count() -> None:
    root = os.urandom(HASH_BYTES)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    assert hash_blocks(root, a + b, BS) != hash_blocks(root, b + a, BS)
    assert hash_blocks(root, [*a, *b, 9, 10], BS) == hash_blocks(root, a + b, BS)
    assert hash_blocks(root, [1, 2, 3], BS) == []


def test_hash_block_tokens_is_one_link_of_the_chain() -> None:
    root = os.urandom(HASH_BYTES)
    first, second = hash_blocks(root, list(range(8)), BS)
    assert hash_block_tokens(root, [0, 1, 2, 3]) == first
    assert hash_block_tokens(first, [4, 5, 6, 7]) == second


def test_a_salt_changes_every_hash() -> None:
    root = os.urandom(HASH_BYTES)
    tokens = list(range(8))
    plain = hash_blocks(root, tokens, BS)
    salted = hash_blocks(root, tokens, BS, b"tenant-a")
    other = hash_blocks(root, tokens, BS, b"tenant-b")
    assert len({*plain, *salted, *other}) == 6
    assert hash_blocks(root, tokens, BS, b"tenant-a") == salted
    assert hash_block_tokens(root, tokens[:BS], b"tenant-a") == salted[0]


def test_the_extra_part_cannot_pose_as_tokens() -> None:
    # Its length is hashed: moving bytes between `extra` and the tokens changes the hash.
    root = os.urandom(HASH_BYTES)
    one = int.from_bytes(b"\x01\x00\x00\x00", "little")
    assert hash_block_tokens(root, [one, 2], b"") != hash_block_tokens(
        root, [2], b"\x01\x00\x00\x00"
    )
    assert hash_block_tokens(root, [1], b"ab") != hash_block_tokens(root, [1], b"a")
