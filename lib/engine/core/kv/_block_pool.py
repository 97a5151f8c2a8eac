"""The KV-cache block pool: reference counts, an LRU free queue, and the prefix-cache index.

A block is *held* while its reference count is above zero (several requests may share a
full block through prefix-cache hits), and *free* otherwise. Free blocks wait in one queue
in LRU order: freed blocks join the tail, allocation takes the head. A free block that still
has a hash is *cached*: a later request with the same prefix may take it back out of the
queue (a hit), and allocation evicts its hash when it reaches the head. So the blocks that
were freed longest ago are reused first, and recently used prefixes survive longest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator


class BlockPool:
    """Block ids `0..num_blocks-1` with reference counts, a free queue and a hash index."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks  # content hash, if cached
        # Insertion order is LRU order; OrderedDict gives O(1) pop-head, append and removal
        # from the middle (a hit on a free cached block).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix-cache index, held or free."""
        return len(self._cached)

    def free_block_ids(self) -> Iterator[int]:
        """Free blocks from the next to be allocated to the last."""
        return iter(self._free)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def get_cached_block(self, block_hash: bytes) -> int | None:
        """The block whose content has `block_hash`, held or free; None on a miss."""
        return self._cached.get(block_hash)

    def take(self, num_blocks: int) -> list[int]:
        """Allocate `num_blocks` from the head of the free queue, evicting their hashes.

        The caller checks `num_free_blocks` first; taking more than are free raises KeyError.
        """
        free, ref_counts, hashes = self._free, self.ref_counts, self.block_hashes
        taken = []
        for _ in range(num_blocks):
            block_id, _ = free.popitem(last=False)
            block_hash = hashes[block_id]
            if block_hash is not None:
                del self._cached[block_hash]
                hashes[block_id] = None
            ref_counts[block_id] = 1
            taken.append(block_id)
        return taken

    def touch(self, block_ids: Iterable[int]) -> None:
        """Share cached blocks with one more request; free ones leave the free queue."""
        free, ref_counts = self._free, self.ref_counts
        for block_id in block_ids:
            if ref_counts[block_id] == 0:
                del free[block_id]
            ref_counts[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; those no one holds join the free queue's tail, in
        the order given (so the caller decides which are evicted first)."""
        free, ref_counts = self._free, self.ref_counts
        for block_id in block_ids:
            ref_counts[block_id] -= 1
            if ref_counts[block_id] == 0:
                free[block_id] = None

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """Index a held, full block under `block_hash`.

        A block with the same content already indexed (two requests computed the same prefix
        side by side) stays the one hits find; this block then stays unindexed, so it is
        plain free space once released.
        """
        if self.block_hashes[block_id] is None and block_hash not in self._cached:
            self._cached[block_hash] = block_id
            self.block_hashes[block_id] = block_hash

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; only possible when no block is held. Returns whether it did."""
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self.block_hashes = [None] * self.num_blocks
        return True
