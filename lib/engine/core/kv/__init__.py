"""The paged KV cache's bookkeeping: which blocks each request holds, and the prefix cache.

Runs in the engine process. Owns the block pool (reference counts, LRU free queue) and the
prefix-cache index over full blocks' chained hashes.
"""
