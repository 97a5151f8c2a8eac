"""N-gram prompt lookup: draft tokens copied from where the sequence's suffix occurred before.

Text that repeats or edits a given passage (code edits, summaries quoting the input, chat
that restates a document) continues as it continued last time. So: take the sequence's last
n tokens, for n from `max_n` down to `min_n`; at the latest earlier place where those n
tokens occur, propose the (up to) k tokens that followed them. The longest suffix wins, as
in vLLM's proposer: a longer context is a better witness. No model runs, so a miss costs a
scan of the row's tokens (numpy, O(length * n)) and nothing else.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Draft tokens for the sequence `tokens` (prompt then outputs), at most `k`.

    Args:
        tokens: int32 [L], the sequence so far.
        min_n, max_n: the suffix lengths tried, longest first.
        k: how many tokens to propose at most.

    Returns:
        int32 [<= k]: the tokens that followed the latest earlier occurrence of the longest
        matching suffix, cut at the sequence's end; empty when no suffix recurs.
    """
    length = len(tokens)
    if length <= min_n or not _occurs(tokens, min_n):  # the common miss: one scan
        return np.zeros(0, np.int32)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows that start before the suffix itself: the candidates' next token exists.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return np.ascontiguousarray(tokens[start : min(start + k, length)], np.int32)
    return np.zeros(0, np.int32)


def _occurs(tokens: np.ndarray, n: int) -> bool:
    """Whether the last `n` tokens occur earlier (a longer suffix can only if they do)."""
    windows = sliding_window_view(tokens[: len(tokens) - 1], n)
    return bool((windows == tokens[len(tokens) - n :]).all(axis=1).any())


def propose_rows(
    token_ids: np.ndarray,
    num_tokens: np.ndarray,
    rows: np.ndarray,
    k: int,
    *,
    min_n: int,
    max_n: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Drafts for each of `rows` of a runner's token table (row r's sequence is
    token_ids[r, :num_tokens[r]]), at most `k` each and never past the table's width.

    Returns:
        (offsets int32 [rows + 1], tokens int32): row i's drafts at tokens[offsets[i]:...].
    """
    width = token_ids.shape[1]
    drafts = []
    for row in rows.tolist():
        n = int(num_tokens[row])
        room = min(k, width - n)
        found = propose_ngram(token_ids[row, :n], min_n, max_n, room) if room > 0 else None
        drafts.append(found if found is not None else np.zeros(0, np.int32))
    offsets = np.zeros(len(drafts) + 1, np.int32)
    np.cumsum([len(d) for d in drafts], out=offsets[1:])
    tokens = np.concatenate(drafts) if drafts else np.zeros(0, np.int32)
    return offsets, tokens.astype(np.int32, copy=False)
