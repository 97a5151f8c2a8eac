"""The engine's grammars: compiled off the caller's thread, failures and timeouts per request,
one cached compile for many requests, and masks that allow exactly the grammar's tokens."""

from __future__ import annotations

import json
import time

import llguidance
import numpy as np
import pytest

from trillm.engine.core._grammar import Grammars, GrammarState, GrammarViolationError

from ...grammars import EOS, VOCAB


@pytest.fixture
def grammars(ll_tokenizer: llguidance.LLTokenizer) -> Grammars:
    g = Grammars(ll_tokenizer, VOCAB, timeout=10.0)
    yield g
    g.close()


def compiled(grammars: Grammars, rnum: int, grammar: str) -> GrammarState:
    grammars.submit(rnum, grammar)
    deadline = time.monotonic() + 30
    while True:
        ready, failed = grammars.poll()
        assert not failed, failed
        if ready:
            ((got, state),) = ready
            assert got == rnum
            return state
        assert time.monotonic() < deadline, "the compile never ended"
        grammars.wait(0.1)


def allowed(bitmask_row: np.ndarray) -> set[int]:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:VOCAB]
    return set(np.flatnonzero(bits).tolist())


def test_a_choice_grammar_allows_its_first_tokens_then_only_eos(
    grammars: Grammars, ll_tokenizer: llguidance.LLTokenizer
) -> None:
    grammar = llguidance.LLMatcher.grammar_from_lark('start: "yes" | "no"')
    state = compiled(grammars, 7, grammar)
    wait = grammars.start_masks([state])
    assert wait is not None
    first = allowed(wait()[0])
    yes, no = ll_tokenizer.tokenize_str("yes"), ll_tokenizer.tokenize_str("no")
    assert yes[0] in first and no[0] in first and EOS not in first
    done = False
    for token in yes:
        done = state.accept(token)
    wait = grammars.start_masks([state])
    assert wait is not None
    assert done or allowed(wait()[0]) == {EOS}


def test_a_token_outside_the_grammar_is_a_violation(grammars: Grammars) -> None:
    state = compiled(grammars, 1, llguidance.LLMatcher.grammar_from_regex("[0-9]+"))
    with pytest.raises(GrammarViolationError, match="is not allowed by the grammar"):
        state.accept(EOS)  # nothing has been generated: not accepting yet


def test_a_bad_grammar_fails_its_request_and_nothing_else(grammars: Grammars) -> None:
    good = llguidance.LLMatcher.grammar_from_regex("a+")
    grammars.submit(1, llguidance.LLMatcher.grammar_from_lark("start: nosuchrule"))
    grammars.submit(2, good)
    results: dict[int, object] = {}
    deadline = time.monotonic() + 30
    while len(results) < 2:
        ready, failed = grammars.poll()
        results.update(dict(ready))
        results.update(dict(failed))
        assert time.monotonic() < deadline
        grammars.wait(0.1)
    assert isinstance(results[2], GrammarState)
    assert isinstance(results[1], str) and results[1].startswith("the grammar does not compile")
    assert "nosuchrule" in results[1]


def test_a_compile_past_the_deadline_fails_with_the_flag_named(
    ll_tokenizer: llguidance.LLTokenizer,
) -> None:
    grammars = Grammars(ll_tokenizer, VOCAB, timeout=0.0)
    try:
        grammars.submit(3, llguidance.LLMatcher.grammar_from_regex("b+"))
        ready, failed = grammars.poll()
        if not ready:  # (a compile may end before the first poll: then it was in time)
            assert failed == [
                (
                    3,
                    "compiling the grammar took longer than 0 s (--structured-outputs-timeout); "
                    "simplify it",
                )
            ]
    finally:
        grammars.close()


def test_one_compile_serves_many_requests_each_with_its_own_state(grammars: Grammars) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    first = compiled(grammars, 1, grammar)
    second = compiled(grammars, 2, grammar)  # from the cache: ready at the first poll
    assert first.matcher is not second.matcher
    wait = grammars.start_masks([first, second])
    assert wait is not None
    masks = wait()
    assert (masks[0] == masks[1]).all()
    brace = next(iter(allowed(masks[0])))
    first.accept(brace)  # the first advances, the second does not
    masks = grammars.start_masks([first, second])()  # type: ignore[misc]
    assert not (masks[0] == masks[1]).all()


def test_no_states_no_masks(grammars: Grammars) -> None:
    assert grammars.start_masks([]) is None


def test_requests_that_share_a_grammar_share_one_compile(grammars: Grammars) -> None:
    grammar = llguidance.LLMatcher.grammar_from_regex("[a-c]{2,5}")
    for rnum in range(4):  # as the children of an n=4 request arrive: before it compiled
        grammars.submit(rnum, grammar)
    futures = {id(future) for future, _, _ in grammars._pending.values()}
    assert len(futures) == 1
    states: dict[int, GrammarState] = {}
    deadline = time.monotonic() + 30
    while len(states) < 4:
        ready, failed = grammars.poll()
        assert not failed
        states.update(ready)
        assert time.monotonic() < deadline
        grammars.wait(0.1)
    assert len({id(s.matcher) for s in states.values()}) == 4  # a state each
