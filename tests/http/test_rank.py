"""`pinned_rank`: vLLM's X-data-parallel-rank header and the body's data_parallel_rank."""

from __future__ import annotations

import pytest

from trillm.http.edge._errors import RequestError
from trillm.http.edge._rank import pinned_rank


def test_the_header_or_the_body_pins_and_neither_leaves_it_to_the_router() -> None:
    assert pinned_rank(None, None, 2) is None
    assert pinned_rank(b"1", None, 2) == 1
    assert pinned_rank(b" 0 ", None, 2) == 0
    assert pinned_rank(None, 1, 2) == 1
    assert pinned_rank(b"1", 1, 2) == 1  # both, agreeing


@pytest.mark.parametrize(
    ("header", "body", "message", "param"),
    [
        (b"one", None, "the X-data-parallel-rank header must be an integer, got 'one'",
         "X-data-parallel-rank"),
        (b"1.0", None, "the X-data-parallel-rank header must be an integer, got '1.0'",
         "X-data-parallel-rank"),
        (b"", None, "the X-data-parallel-rank header must be an integer, got ''",
         "X-data-parallel-rank"),
        (b"2", None, "the X-data-parallel-rank header must be in [0, 2) "
         "(--data-parallel-size 2), got 2", "X-data-parallel-rank"),
        (b"-1", None, "the X-data-parallel-rank header must be in [0, 2) "
         "(--data-parallel-size 2), got -1", "X-data-parallel-rank"),
        (None, 5, "data_parallel_rank must be in [0, 2) (--data-parallel-size 2), got 5",
         "data_parallel_rank"),
        (b"0", 1, "the X-data-parallel-rank header (0) and data_parallel_rank (1) name "
         "different engines: send one of them", "data_parallel_rank"),
    ],
)  # fmt: skip
def test_a_bad_rank_is_a_400_naming_where_it_came_from(
    header: bytes | None, body: int | None, message: str, param: str
) -> None:
    with pytest.raises(RequestError) as caught:
        pinned_rank(header, body, 2)
    assert (caught.value.status, caught.value.message, caught.value.param) == (400, message, param)
