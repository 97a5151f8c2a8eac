"""`Admission`: the queue counts prompts x n; every refusal word for word."""

from __future__ import annotations

import re

import pytest

from trillm.http.edge._admission import Admission
from trillm.http.edge._errors import RequestError


def test_a_request_holds_its_weight_until_it_ends() -> None:
    admission = Admission(max_queued=8, max_per_request=100)
    with admission.hold() as held:
        assert admission.queued == 1
        held.grow(6, what="3 prompts x n 2")
        assert admission.queued == 6
        with admission.hold() as other:
            other.grow(2, what="2 prompts x n 1")
            assert admission.queued == 8 and not admission.has_room()
        assert admission.queued == 6
    assert admission.queued == 0


def test_a_request_that_does_not_fit_now_is_a_429() -> None:
    admission = Admission(max_queued=8, max_per_request=100)
    with admission.hold() as held:
        held.grow(6, what="6 prompts x n 1")
        with admission.hold() as other, pytest.raises(RequestError) as info:
            other.grow(3, what="3 prompts x n 1")
        assert (info.value.status, info.value.code) == (429, "overloaded")
        assert info.value.headers == {"Retry-After": "1"}
        assert admission.queued == 6  # the refused one let go of its 1 too
        for _ in range(2):
            with admission.hold():
                pass
    assert admission.queued == 0


def test_a_request_too_large_ever_to_fit_is_a_400() -> None:
    admission = Admission(max_queued=8, max_per_request=12)
    message = (
        "this request asks for 20000 prompts x n 4 = 80000 completions, more than "
        "--max-prompts-per-request (12); split it into smaller requests"
    )
    with admission.hold() as held, pytest.raises(RequestError, match=f"^{re.escape(message)}$"):
        held.grow(80000, what="20000 prompts x n 4")
    message = (
        "this request asks for 1 conversation x n 10 = 10 completions, more than the whole "
        "queue holds (--max-queued-requests 8); split it into smaller requests"
    )
    with admission.hold() as held, pytest.raises(RequestError, match=f"^{re.escape(message)}$"):
        held.grow(10, what="1 conversation x n 10", param="n")
    assert admission.queued == 0


def test_the_queue_is_released_on_an_error() -> None:
    admission = Admission(max_queued=2, max_per_request=2)
    with pytest.raises(ValueError), admission.hold() as held:
        held.grow(2, what="2 prompts x n 1")
        raise ValueError
    assert admission.queued == 0
    with admission.hold(), admission.hold(), pytest.raises(RequestError, match="overloaded"):
        admission.take(1)
