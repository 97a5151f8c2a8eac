"""Which KV-cache blocks each request holds, and the prefix cache over full blocks.

A request's KV lives in blocks of `block_size` tokens, listed in position order. A full
block is identified by a sha256 chained over everything before it, from a random root drawn
by this manager (`_block_hash`), so equal hashes mean equal prefixes and no client can craft
a collision. A request's `cache_salt` is mixed into its first block's hash (vLLM's scheme):
requests with different salts, or one without, never share a block; so is a LoRA adapter's
digest (DESIGN.md §7), so no adapter reads another's KV, nor the base model's. Blocks are indexed as
soon as their KV is computed (`cache_blocks`, after each step), so a request that arrives
later with the same prefix shares them instead of recomputing them.
"""

from __future__ import annotations

from ..sched._request import Request, RequestStatus
from ._block_hash import hash_block_tokens, hash_blocks, new_root_hash
from ._block_pool import BlockPool


class KVCacheManager:
    """Allocates, shares and frees blocks per request; counts prefix-cache hits in tokens."""

    def __init__(
        self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.root_hash = new_root_hash()  # the parent of every request's first block
        self._blocks: dict[int, list[int]] = {}  # rnum -> block ids in position order
        self._num_cached_blocks: dict[int, int] = {}  # rnum -> leading blocks already indexed
        # As vLLM's metrics: tokens looked up and tokens found, once per request (the first
        # time it is scheduled; lookups after a preemption are not counted).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def get_block_ids(self, rnum: int) -> list[int]:
        """The blocks `rnum` holds, in position order (the live list: do not mutate it)."""
        return self._blocks.get(rnum, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of `request`'s full blocks, and its length in tokens.

        At least one token is always left to compute, since the runner samples from the last
        token's hidden state: when every block is cached, the last hit is dropped.
        """
        if not self._reads_prefix_cache(request):
            return [], 0
        num_lookups = (request.num_tokens - 1) // self.block_size
        if len(request.block_hashes) < num_lookups:
            self._hash_blocks(request, num_lookups)  # computed once: cache_blocks needs them too
        pool, hashes = self.pool, request.block_hashes
        hits: list[int] = []
        for i in range(num_lookups):
            block_id = pool.get_cached_block(hashes[i])
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `request`; all or nothing.

        Args:
            request: its `num_computed_tokens` are already in its blocks.
            num_new_tokens: tokens to compute next.
            new_computed_blocks: prefix-cache hits from `get_computed_blocks`, when the request
                is being admitted (holds no blocks yet); they count as computed and are shared.
                Passing a list (even empty) marks the admission for the hit counters.

        Returns:
            The newly allocated block ids (not the hits), or None when too few blocks are free.
        """
        blocks = self._blocks.get(request.rnum)
        if blocks is None:
            return self._allocate_first(request, num_new_tokens, new_computed_blocks)
        if new_computed_blocks:
            raise ValueError("prefix-cache hits can only start a request's blocks")
        num_tokens = request.num_computed_tokens + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(blocks)
        if num_needed <= 0:
            return []  # the decode path, mostly: room left in the last block
        if num_needed > self.pool.num_free_blocks:
            return None
        new_blocks = self.pool.take(num_needed)
        blocks.extend(new_blocks)
        return new_blocks

    def _allocate_first(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] | None
    ) -> list[int] | None:
        hits = new_computed_blocks or []
        block_size = self.block_size
        num_tokens = request.num_computed_tokens + len(hits) * block_size + num_new_tokens
        num_needed = max(0, -(-num_tokens // block_size) - len(hits))
        ref_counts = self.pool.ref_counts
        num_free_hits = sum(1 for block_id in hits if ref_counts[block_id] == 0)
        if num_needed > self.pool.num_free_blocks - num_free_hits:
            return None
        self.pool.touch(hits)
        new_blocks = self.pool.take(num_needed)
        self._blocks[request.rnum] = [*hits, *new_blocks]
        self._num_cached_blocks[request.rnum] = len(hits)
        if (
            new_computed_blocks is not None
            and request.status is RequestStatus.WAITING
            and self._reads_prefix_cache(request)
        ):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(hits) * block_size
        return new_blocks

    def free(self, request: Request) -> None:
        """Release `request`'s blocks (idempotent).

        They join the free queue last block first, so a request's tail, the part least
        likely to be shared, is evicted before its head.
        """
        blocks = self._blocks.pop(request.rnum, None)
        if blocks is not None:
            del self._num_cached_blocks[request.rnum]
            self.pool.release(reversed(blocks))

    def cache_blocks(self, request: Request) -> None:
        """Index `request`'s blocks that became full of computed tokens since the last call."""
        if not self.enable_prefix_caching or request.prompt_embeds:
            return
        # Only known tokens: a placeholder's KV (async scheduling) has no hash yet.
        known = min(request.num_computed_tokens, len(request.all_token_ids))
        num_full = known // self.block_size
        num_cached = self._num_cached_blocks.get(request.rnum)
        if num_cached is None or num_full <= num_cached:
            return
        self._hash_blocks(request, num_full)
        blocks, hashes = self._blocks[request.rnum], request.block_hashes
        for i in range(num_cached, num_full):
            self.pool.cache(blocks[i], hashes[i])
        self._num_cached_blocks[request.rnum] = num_full

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any request holds blocks."""
        return self.pool.reset_prefix_cache()

    def _reads_prefix_cache(self, request: Request) -> bool:
        # Prompt logprobs need every prompt position computed, so a request that still owes
        # some does not skip them through the cache (vLLM does the same).
        # A prompt of embeddings has placeholder token ids: a hash of them names nothing.
        return (
            self.enable_prefix_caching
            and not request.prompt_embeds
            and (
                request.options.prompt_logprobs is None
                or request.prompt_logprobs_end >= request.num_prompt_tokens
            )
        )

    def _hash_blocks(self, request: Request, num_blocks: int) -> None:
        """Extend `request.block_hashes` to its first `num_blocks` (full) blocks."""
        hashes, block_size = request.block_hashes, self.block_size
        parent = hashes[-1] if hashes else self.root_hash
        tokens = request.all_token_ids[len(hashes) * block_size : num_blocks * block_size]
        if not hashes and (request.cache_salt or request.lora_digest) and len(tokens) >= block_size:
            # The salt goes into the first block only, as vLLM's: every later hash chains
            # from it, so the whole prefix is the salt's tenant's alone. An adapter's digest
            # follows a 0xff byte, which UTF-8 never holds: no salt reads as an adapter.
            extra = request.cache_salt.encode()
            if request.lora_digest:
                extra += b"\xff" + request.lora_digest
            hashes.append(hash_block_tokens(parent, tokens[:block_size], extra))
            parent, tokens = hashes[-1], tokens[block_size:]
        hashes.extend(hash_blocks(parent, tokens, block_size))
