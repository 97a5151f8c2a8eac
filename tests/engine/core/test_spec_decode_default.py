"""Speculative decoding on the default model (SmolLM2-135M, float32), and under grammars.

The scheduler and a real runner are stepped as the busy loop steps them (grammar masks
included, as `EngineCore._step` computes them). Greedy tokens with speculation must equal
those without: n-gram lookup on prompts that ask to copy a text (drafts mostly right), the
draft model with the target as its own draft (every draft right: acceptance 100%), and a
JSON schema whose output repeats itself (drafts verified under per-position masks), with
drafts the grammar refuses mixed in (cut before the step by `usable_drafts`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import pytest

from trillm.common.speculative import parse_speculative_config
from trillm.common.wire import SamplingOptions
from trillm.default_model import default_model_dir
from trillm.engine.core._grammar import Grammars, GrammarState
from trillm.engine.core.sched._request import Request
from trillm.engine.core.sched._scheduler import Scheduler, SchedulerConfig
from trillm.engine.core.sched._spec_decode import usable_drafts
from trillm.gpu import ModelRunner
from trillm.gpu.spec_decode import _verify

from ...gpu.conftest import make_runner
from ...grammars import VOCAB

BLOCK = 16
NGRAM = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
)
GREEDY = SamplingOptions(temperature=0.0)
TEXT = (
    "The scheduler decides each step: running requests first, then waiting ones, in the "
    "order they came, within the token budget. A request whose blocks do not fit preempts "
    "the newest running one, whose blocks are freed and recomputed later."
)
# The schema's only strings are two fixed values, so its output repeats itself and lookup
# finds drafts the grammar allows; "zebra" it never allows.
SCHEMA = {
    "type": "object",
    "properties": {
        "colors": {
            "type": "array",
            "items": {"type": "string", "enum": ["red fox", "blue fox"]},
            "minItems": 8,
            "maxItems": 8,
        }
    },
    "required": ["colors"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir(progress=False)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> ModelRunner:
    return make_runner(model_dir, num_blocks=128, block_size=BLOCK, speculative_config=NGRAM)


@pytest.fixture
def grammars(ll_tokenizer: Any) -> Iterator[Grammars]:
    g = Grammars(ll_tokenizer, VOCAB, timeout=10.0)
    yield g
    g.close()


def json_grammar(ll_tokenizer: Any) -> GrammarState:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    return GrammarState(llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0))


def run(
    runner: ModelRunner,
    prompts: list[list[int]],
    *,
    spec: str | None,
    max_tokens: int,
    grammar: Callable[[], GrammarState] | None = None,
    grammars: Grammars | None = None,
) -> tuple[dict[int, list[int]], Scheduler]:
    """Every request's tokens, stepping scheduler and runner (and the masks) to the end."""
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=128,
            block_size=BLOCK,
            max_num_seqs=8,
            max_num_batched_tokens=512,
            max_model_len=1024,
            speculative=parse_speculative_config(spec),
        )
    )
    for rnum, prompt in enumerate(prompts):
        request = Request(rnum, list(prompt), GREEDY, max_tokens, eos_token_id=2)
        if grammar is not None:
            request.grammar = grammar()
        scheduler.add_request(request)
    tokens: dict[int, list[int]] = {r: [] for r in range(len(prompts))}
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        batch = scheduler.schedule()
        masks = None
        if len(batch.grammar_rnums):
            assert grammars is not None
            masks = grammars.start_masks(
                scheduler.grammar_states(batch), scheduler.grammar_drafts(batch)
            )
        result = scheduler.update_from_output(batch, runner.execute(batch, masks))
        offsets = result.tok_offsets.tolist()
        for i, rnum in enumerate(result.rnums.tolist()):
            tokens[rnum] += result.tokens[offsets[i] : offsets[i + 1]].tolist()
    assert not scheduler.has_unfinished_requests()
    runner.remove_requests(np.arange(len(prompts), dtype=np.uint64))
    return tokens, scheduler


def copy_prompts(tokenizer: Any) -> list[list[int]]:
    asks = ("Repeat this text exactly:\n\n", "Copy the text below, word for word.\n\n")
    return [list(tokenizer.encode(ask + TEXT + "\n\n").ids) for ask in asks]


# -- without a model ---------------------------------------------------------------------------


def test_drafts_the_grammar_refuses_are_cut_before_the_step(ll_tokenizer: Any) -> None:
    state = json_grammar(ll_tokenizer)
    valid = ll_tokenizer.tokenize_str('{"colors": ["red')
    zebra = ll_tokenizer.tokenize_str("zebra")
    request = Request(0, [1, 2, 3], GREEDY, 64)
    request.grammar = state
    request.spec_token_ids = [*valid, *zebra, *valid]
    assert usable_drafts(request, budget=64, max_model_len=1024) == valid
    request.spec_token_ids = [*zebra, *valid]
    assert usable_drafts(request, budget=64, max_model_len=1024) == []
    assert not state.matcher.is_error()  # validation consumed nothing


# -- the default model (slow: it loads 135M parameters and decodes hundreds of tokens) -------


@pytest.mark.slow
def test_ngram_speculation_gives_the_default_model_s_greedy_tokens(
    runner: ModelRunner, tokenizer: Any
) -> None:
    prompts = copy_prompts(tokenizer)
    plain, _ = run(runner, prompts, spec=None, max_tokens=48)
    tokens, scheduler = run(runner, prompts, spec=NGRAM, max_tokens=48)
    assert tokens == plain
    stats = scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens


@pytest.mark.slow
def test_the_default_model_as_its_own_draft_accepts_every_draft(
    model_dir: Path, tokenizer: Any
) -> None:
    spec = json.dumps(
        {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3}
    )
    drafted = make_runner(model_dir, num_blocks=128, block_size=BLOCK, speculative_config=spec)
    prompts = copy_prompts(tokenizer)
    plain, _ = run(drafted, prompts, spec=None, max_tokens=32)
    tokens, scheduler = run(drafted, prompts, spec=spec, max_tokens=32)
    assert tokens == plain
    stats = scheduler.spec_stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def refused_last_draft(ll_tokenizer: Any) -> Callable[..., tuple[np.ndarray, np.ndarray]]:
    """Lookup's drafts, each row's last one replaced by a token the schema never allows."""
    (zebra,) = ll_tokenizer.tokenize_str(" zebra")[:1]
    propose = _verify.propose_rows

    def proposer(*args: Any, **kw: Any) -> tuple[np.ndarray, np.ndarray]:
        offsets, tokens = propose(*args, **kw)
        tokens = tokens.copy()
        ends = offsets[1:][np.diff(offsets) > 0] - 1
        tokens[ends] = zebra
        return offsets, tokens

    return proposer


@pytest.mark.slow
def test_a_json_schema_with_drafts_gives_valid_json_and_the_same_tokens(
    runner: ModelRunner,
    tokenizer: Any,
    ll_tokenizer: Any,
    grammars: Grammars,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompt = [list(tokenizer.encode("Name eight colors of foxes as JSON.\n").ids)]

    def grammar() -> GrammarState:
        return json_grammar(ll_tokenizer)

    plain, _ = run(runner, prompt, spec=None, max_tokens=120, grammar=grammar, grammars=grammars)
    tokens, scheduler = run(
        runner, prompt, spec=NGRAM, max_tokens=120, grammar=grammar, grammars=grammars
    )
    assert tokens == plain
    text = tokenizer.decode(tokens[0])
    assert len(json.loads(text)["colors"]) == 8
    stats = scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens  # masks per position ran

    monkeypatch.setattr(_verify, "propose_rows", refused_last_draft(ll_tokenizer))
    cut, scheduler = run(
        runner, prompt, spec=NGRAM, max_tokens=120, grammar=grammar, grammars=grammars
    )
    assert cut == plain
    assert scheduler.spec_stats.num_accepted_tokens > 0  # the drafts before "zebra" ran
