"""Which engine a request goes to, under data parallelism: by load, with prefix affinity.

Each engine has its own KV cache, so a prompt is cheapest on the engine that already holds
its prefix. The frontend cannot see the engines' caches, but it saw every prompt it routed:
it remembers, for block-aligned prefixes of 1, 2, 4, ... 32 blocks (LRU, bounded), which
engine last took them. A request goes to the engine of its longest remembered prefix unless
that engine is busier than the least-loaded one by more than `slack` requests; otherwise to
the least-loaded live engine (the lowest index on ties). Which engines are live is the
`EnginePool`'s to say; the router is told with each choice. Load is the requests (children)
routed to an engine and not yet ended, counted here: no round trip to the engines.

The remembered prefixes are keyed by Python's `hash()` of the tokens, which anyone can
collide on purpose; that is enough here, since a key only picks an engine: a collision moves
a request to another engine, never to another prompt's KV (the engines match blocks by their
own sha256 chains, `engine.core._block_hash`), and the slack bounds the imbalance it causes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

MAX_PREFIXES = 1 << 14
PREFIX_BLOCKS = (32, 16, 8, 4, 2, 1)  # longest first


class EngineRouter:
    """Load and prefix bookkeeping for `num_engines` engines."""

    def __init__(self, num_engines: int, block_size: int, *, slack: int = 8) -> None:
        self.loads = [0] * num_engines
        self.block_size = block_size
        self.slack = slack
        self._prefixes: OrderedDict[tuple[int, int], int] = OrderedDict()

    def _keys(self, token_ids: Sequence[int], cache_salt: str) -> list[tuple[int, int]]:
        """(length, hash) of each block-aligned prefix short of the whole prompt, within
        its cache salt's tenant (another salt's blocks are not its to share)."""
        usable = (len(token_ids) - 1) // self.block_size  # the last token is always computed
        keys = []
        for blocks in PREFIX_BLOCKS:
            if blocks <= usable:
                n = blocks * self.block_size
                keys.append((n, hash((cache_salt, tuple(token_ids[:n])))))
        return keys

    def choose(self, token_ids: Sequence[int], live: Sequence[int], cache_salt: str = "") -> int:
        """The engine for a prompt among the `live` ones; LookupError when there is none."""
        if not live:
            raise LookupError("no engine is alive")
        if len(self.loads) == 1:  # nothing to choose: no prefix bookkeeping per request
            return live[0]
        least = min(live, key=lambda i: self.loads[i])
        keys = self._keys(token_ids, cache_salt)
        chosen = least
        for key in keys:
            engine = self._prefixes.get(key)
            if engine is not None and engine in live:
                if self.loads[engine] <= self.loads[least] + self.slack:
                    chosen = engine
                break
        self._remember(keys, chosen)
        return chosen

    def remember(self, token_ids: Sequence[int], engine: int, cache_salt: str = "") -> None:
        """A request the router did not choose for (pinned to `engine` by its caller) leaves
        its prefix there all the same: later ones may share it."""
        if len(self.loads) > 1:
            self._remember(self._keys(token_ids, cache_salt), engine)

    def _remember(self, keys: list[tuple[int, int]], engine: int) -> None:
        for key in keys:
            self._prefixes[key] = engine
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > MAX_PREFIXES:
            self._prefixes.popitem(last=False)

    def engine_died(self, engine: int) -> None:
        """Forget the prefixes `engine` held: its KV cache is gone."""
        for key in [k for k, e in self._prefixes.items() if e == engine]:
            del self._prefixes[key]
