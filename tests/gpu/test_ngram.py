"""Unit tests of n-gram prompt lookup (private module `_ngram`)."""

from __future__ import annotations

import numpy as np

from trillm.gpu.spec_decode._ngram import propose_ngram


def ids(*tokens: int) -> np.ndarray:
    return np.array(tokens, np.int32)


def test_the_tokens_after_the_suffix_s_earlier_occurrence() -> None:
    tokens = ids(1, 2, 3, 4, 5, 6, 9, 2, 3)
    assert propose_ngram(tokens, 2, 3, 3).tolist() == [4, 5, 6]


def test_no_recurring_suffix_proposes_nothing() -> None:
    assert propose_ngram(ids(1, 2, 3, 4), 1, 3, 4).tolist() == []
    assert propose_ngram(ids(7), 1, 3, 4).tolist() == []


def test_the_longest_suffix_wins_over_a_later_shorter_one() -> None:
    # "2 3" occurs last at index 5 (followed by 8), but "1 2 3" at 0 (followed by 4).
    tokens = ids(1, 2, 3, 4, 0, 2, 3, 8, 1, 2, 3)
    assert propose_ngram(tokens, 1, 3, 1).tolist() == [4]
    assert propose_ngram(tokens, 1, 2, 1).tolist() == [8]  # only 2-grams: the latest


def test_the_latest_occurrence_among_equals_and_the_cut_at_the_end() -> None:
    tokens = ids(5, 6, 1, 5, 6, 2, 5, 6)
    assert propose_ngram(tokens, 2, 2, 2).tolist() == [2, 5]
    # A loop: the latest occurrence is one before the end, so one token follows it.
    assert propose_ngram(ids(3, 3, 3, 3), 2, 2, 4).tolist() == [3]


def test_below_min_n_nothing_matches() -> None:
    tokens = ids(9, 1, 2, 7, 2)
    assert propose_ngram(tokens, 2, 4, 3).tolist() == []
    assert propose_ngram(tokens, 1, 4, 3).tolist() == [7, 2]
