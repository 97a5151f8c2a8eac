"""The block pool and KV-cache manager: allocation, sharing, LRU eviction, hit counting."""

from __future__ import annotations

import pytest

from trillm.engine.core.kv._block_hash import hash_block_tokens
from trillm.engine.core.kv._block_pool import BlockPool
from trillm.engine.core.kv._kv_cache_manager import KVCacheManager
from trillm.engine.core.sched._request import Request, RequestStatus
from trillm.gpu import SamplingOptions

BS = 4


def make_request(rnum: int, prompt: list[int], **options: object) -> Request:
    return Request(rnum, list(prompt), SamplingOptions(**options), max_tokens=16)  # type: ignore[arg-type]


def admit(kv: KVCacheManager, request: Request) -> list[int]:
    """Look up, allocate the whole prompt, compute it and cache it, as the scheduler would."""
    hits, num_hit = kv.get_computed_blocks(request)
    new = kv.allocate_slots(request, request.num_tokens - num_hit, hits)
    assert new is not None
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request)
    return kv.get_block_ids(request.rnum)


def test_allocate_slots_grows_a_block_at_a_time() -> None:
    kv = KVCacheManager(8, BS)
    request = make_request(1, list(range(6)))
    assert kv.allocate_slots(request, 6, []) == [0, 1]
    request.num_computed_tokens = 6
    assert kv.allocate_slots(request, 1) == []  # slot 7 of 8: room in block 1
    request.num_computed_tokens = 8
    assert kv.allocate_slots(request, 1) == [2]
    assert kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)


def test_allocate_slots_is_all_or_nothing() -> None:
    kv = KVCacheManager(3, BS)
    first, second = make_request(1, [1] * 8), make_request(2, [2] * 8)
    assert kv.allocate_slots(first, 8, []) == [0, 1]
    assert kv.allocate_slots(second, 8, []) is None
    assert kv.num_free_blocks == 1
    assert kv.get_block_ids(2) == []


def test_repeated_prompt_hits_shared_blocks_counted_in_tokens() -> None:
    kv = KVCacheManager(16, BS)
    prompt = list(range(10))  # two full blocks and two tokens
    first, second = make_request(1, prompt), make_request(2, prompt)
    blocks = admit(kv, first)
    hits, num_hit = kv.get_computed_blocks(second)
    assert (hits, num_hit) == (blocks[:2], 8)
    kv.allocate_slots(second, 2, hits)
    assert kv.get_block_ids(2)[:2] == blocks[:2]
    assert kv.get_block_ids(2)[2] != blocks[2]
    assert [kv.pool.ref_counts[b] for b in blocks] == [2, 2, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)
    kv.free(first)
    assert [kv.pool.ref_counts[b] for b in blocks] == [1, 1, 0]
    assert kv.pool.is_free(blocks[2]) and not kv.pool.is_free(blocks[0])


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    kv = KVCacheManager(16, BS)
    prompt = list(range(8))  # exactly two blocks
    admit(kv, make_request(1, prompt))
    hits, num_hit = kv.get_computed_blocks(make_request(2, prompt))
    assert num_hit == 4 and len(hits) == 1


def test_generated_tokens_are_cached_too() -> None:
    kv = KVCacheManager(16, BS)
    first = make_request(1, [5, 6, 7])
    admit(kv, first)
    for token in (8, 9):  # decode: the sampled token's KV is computed the next step
        first.append_output_token(token)
        kv.allocate_slots(first, 1)
        first.num_computed_tokens += 1
        kv.cache_blocks(first)
    assert kv.get_computed_blocks(make_request(2, [5, 6, 7, 8, 9]))[1] == 4


def test_free_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    kv = KVCacheManager(6, BS)
    a = make_request(1, list(range(12)))  # blocks 0, 1, 2, all full and cached
    b = make_request(2, list(range(100, 108)))  # blocks 3, 4
    assert admit(kv, a) == [0, 1, 2]
    assert admit(kv, b) == [3, 4]
    kv.free(b)
    kv.free(a)
    # Uncached block 5 first, then b's blocks tail first, then a's.
    assert list(kv.pool.free_block_ids()) == [5, 4, 3, 2, 1, 0]
    # A hit takes a free cached block back out of the queue.
    hits, _ = kv.get_computed_blocks(make_request(3, list(range(9))))
    assert hits == [0, 1]
    c = make_request(3, list(range(9)))
    assert kv.allocate_slots(c, 1, hits) == [5]
    assert list(kv.pool.free_block_ids()) == [4, 3, 2]
    # Allocation evicts b's tail first: b's first block is still a hit, its second is not.
    d = make_request(4, [7])
    assert kv.allocate_slots(d, 1, []) == [4]
    assert kv.get_computed_blocks(make_request(5, [*range(100, 108), 0]))[0] == [3]


def test_hits_on_free_blocks_count_against_free_space() -> None:
    kv = KVCacheManager(3, BS)
    a = make_request(1, list(range(8)))
    admit(kv, a)
    kv.free(a)  # blocks 0, 1 free but cached; block 2 never used
    b = make_request(2, list(range(9)) + [50] * 6)  # hits block 0..1, needs 2 more blocks
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits) is None
    assert kv.num_free_blocks == 3 and kv.prefix_cache_queries == 8  # a's only


def test_lookups_after_preemption_or_without_caching_are_not_counted() -> None:
    kv = KVCacheManager(8, BS)
    request = make_request(1, list(range(9)))
    admit(kv, request)
    kv.free(request)
    request.status = RequestStatus.PREEMPTED
    request.num_computed_tokens = 0
    hits, num_hit = kv.get_computed_blocks(request)
    assert num_hit == 8
    kv.allocate_slots(request, 1, hits)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9, 0)


def test_without_prefix_caching_nothing_is_hashed_or_shared() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    first, second = make_request(1, list(range(9))), make_request(2, list(range(9)))
    admit(kv, first)
    assert first.block_hashes == [] and kv.pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(second) == ([], 0)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)


def test_requests_owing_prompt_logprobs_do_not_read_the_cache() -> None:
    kv = KVCacheManager(8, BS)
    admit(kv, make_request(1, list(range(9))))
    echo = make_request(2, list(range(9)), prompt_logprobs=0)
    assert kv.get_computed_blocks(echo) == ([], 0)
    echo.prompt_logprobs_end = 9  # all reported (before a preemption)
    assert kv.get_computed_blocks(echo)[1] == 8


def test_same_prefix_computed_side_by_side_is_indexed_once() -> None:
    kv = KVCacheManager(8, BS)
    a, b = make_request(1, list(range(5))), make_request(2, list(range(5)))
    for request in (a, b):  # both admitted before either is cached
        kv.allocate_slots(request, 5, kv.get_computed_blocks(request)[0])
    for request in (a, b):
        request.num_computed_tokens = 5
        kv.cache_blocks(request)
    assert kv.pool.num_cached_blocks == 1
    assert kv.pool.block_hashes[kv.get_block_ids(2)[0]] is None
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 8


def test_reset_prefix_cache_refused_while_blocks_are_held() -> None:
    kv = KVCacheManager(8, BS)
    request = make_request(1, list(range(9)))
    admit(kv, request)
    assert kv.reset_prefix_cache() is False
    kv.free(request)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_request(2, list(range(9)))) == ([], 0)


def test_free_is_idempotent() -> None:
    kv = KVCacheManager(4, BS)
    request = make_request(1, [1, 2, 3])
    admit(kv, request)
    kv.free(request)
    kv.free(request)
    assert kv.num_free_blocks == 4 and kv.pool.ref_counts == [0, 0, 0, 0]


def test_block_pool_take_evicts_hashes() -> None:
    pool = BlockPool(2)
    [block] = pool.take(1)
    pool.cache(block, 1234)
    pool.release([block])
    assert pool.get_cached_block(1234) == block
    pool.take(2)
    assert pool.get_cached_block(1234) is None and pool.num_free_blocks == 0


def salted(rnum: int, prompt: list[int], salt: str) -> Request:
    request = make_request(rnum, prompt)
    request.cache_salt = salt
    return request


def test_cache_salts_isolate_tenants_as_the_hit_counters_show() -> None:
    """Same prompt and salt hit; another salt misses; no salt is a tenant of its own."""
    kv = KVCacheManager(64, BS)
    prompt = list(range(13))  # three full blocks: 12 tokens can hit
    admit(kv, salted(1, prompt, "tenant-a"))
    assert kv.prefix_cache_hits == 0
    admit(kv, salted(2, prompt, "tenant-a"))
    assert kv.prefix_cache_hits == 12
    admit(kv, salted(3, prompt, "tenant-b"))
    assert kv.prefix_cache_hits == 12  # another salt: every block missed
    admit(kv, make_request(4, prompt))
    assert kv.prefix_cache_hits == 12  # no salt is not a salt's tenant either
    admit(kv, make_request(5, prompt))
    assert kv.prefix_cache_hits == 24  # ... but shares with the other unsalted requests
    admit(kv, salted(6, prompt, "tenant-b"))
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (6 * 13, 36)


def test_the_salt_is_mixed_into_the_first_block_only() -> None:
    prompt = list(range(9))
    plain, salt = make_request(1, prompt), salted(2, prompt, "s")
    kv = KVCacheManager(16, BS)
    kv.get_computed_blocks(plain)
    kv.get_computed_blocks(salt)
    assert salt.block_hashes[0] == hash_block_tokens(kv.root_hash, prompt[:BS], b"s")
    assert salt.block_hashes[1] == hash_block_tokens(salt.block_hashes[0], prompt[BS : 2 * BS])
    assert set(salt.block_hashes).isdisjoint(plain.block_hashes)  # the chain carries it


def test_a_prompt_of_embeddings_neither_reads_nor_fills_the_prefix_cache() -> None:
    """Its token ids are placeholders: a hash of them would name other prompts' KV."""
    kv = KVCacheManager(64, BS)
    prompt = [0] * 9
    admit(kv, make_request(1, prompt))  # placeholders as real tokens: cached
    embedded = make_request(2, prompt)
    embedded.prompt_embeds = bytes(4 * 9 * 8)
    admit(kv, embedded)
    assert kv.prefix_cache_hits == 0 and not embedded.block_hashes
    admit(kv, make_request(3, prompt))
    assert kv.prefix_cache_hits == 8  # the first request's blocks, not the embedded one's
