"""Speculative decoding through the scheduler and a real runner, in process (tiny model).

The scheduler and the runner are stepped as the busy loop steps them; each request's tokens
are read from the step results, as the STEP record carries them. With speculation the
tokens must equal those without (greedy; seeded random rows too, by the runner's rewind of
their generators); the bookkeeping is checked where it can go wrong: rollback at block
boundaries, preemption between a proposal and its verification, stops inside a run (those
are marked slow: each steps the runner through hundreds of tokens; `make test-slow`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trillm.common.speculative import parse_speculative_config
from trillm.common.wire import SamplingOptions
from trillm.engine.core.sched._request import Request
from trillm.engine.core.sched._scheduler import Scheduler, SchedulerConfig
from trillm.gpu import ModelRunner
from trillm.gpu.spec_decode import _verify

from ...gpu.conftest import make_runner, save_tiny

GREEDY = SamplingOptions(temperature=0.0)
BLOCK = 8
# Repetitive prompts: the tiny random model loops, and lookup finds its loops too.
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    list(range(40, 57)),
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4],
    [11, 12, 11, 12, 11],
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("spec-tiny"), "llama")


def ngram(k: int = 3, **extra: int) -> str:
    return json.dumps(
        {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 4,
            **extra,
        }
    )


def run(
    runner: ModelRunner,
    prompts: list[list[int]],
    *,
    spec: str | None,
    max_tokens: int = 24,
    options: list[SamplingOptions] | None = None,
    num_blocks: int = 64,
    stop: dict[int, list[int]] | None = None,
) -> tuple[dict[int, list[int]], Scheduler]:
    """Every request's tokens, stepping scheduler and runner to the end."""
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=BLOCK,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=128,
            speculative=parse_speculative_config(spec),
        )
    )
    for rnum, prompt in enumerate(prompts):
        opts = options[rnum] if options else GREEDY
        if stop and rnum in stop:
            opts = SamplingOptions(temperature=opts.temperature, stop_token_ids=stop[rnum])
        scheduler.add_request(Request(rnum, list(prompt), opts, max_tokens))
    tokens: dict[int, list[int]] = {r: [] for r in range(len(prompts))}
    for _ in range(1000):
        if not scheduler.has_unfinished_requests():
            break
        batch = scheduler.schedule()
        result = scheduler.update_from_output(batch, runner.execute(batch))
        offsets = result.tok_offsets.tolist()
        for i, rnum in enumerate(result.rnums.tolist()):
            tokens[rnum] += result.tokens[offsets[i] : offsets[i + 1]].tolist()
    assert not scheduler.has_unfinished_requests()
    runner.remove_requests(np.arange(len(prompts), dtype=np.uint64))
    return tokens, scheduler


@pytest.fixture(scope="module")
def runner(tiny_dir: Path) -> ModelRunner:
    return make_runner(tiny_dir, num_blocks=64, block_size=BLOCK, speculative_config=ngram(3))


def noisy_proposer(seed: int = 0) -> object:
    """The tiny random model repeats its last token, which lookup always guesses: drafts
    of its own last token, each replaced by another token with probability 0.4 (a fixed
    seed), give partial acceptance at every position instead."""
    rng = np.random.default_rng(seed)

    def propose(
        token_ids: np.ndarray, num_tokens: np.ndarray, rows: np.ndarray, k: int, **_: int
    ) -> tuple[np.ndarray, np.ndarray]:
        drafts = []
        for row in rows.tolist():
            n = int(num_tokens[row])
            count = int(min(k, token_ids.shape[1] - n))
            draft = np.full(count, token_ids[row, n - 1], np.int32)
            wrong = rng.random(count) < 0.4
            draft[wrong] = rng.integers(0, 100, int(wrong.sum()))
            drafts.append(draft)
        offsets = np.zeros(len(drafts) + 1, np.int32)
        np.cumsum([len(d) for d in drafts], out=offsets[1:])
        return offsets, np.concatenate(drafts).astype(np.int32)

    return propose


@pytest.fixture(autouse=True)
def noisy_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_verify, "propose_rows", noisy_proposer())


def test_greedy_tokens_are_the_same_with_ngram_speculation(runner: ModelRunner) -> None:
    plain, _ = run(runner, PROMPTS, spec=None)
    spec, scheduler = run(runner, PROMPTS, spec=ngram(3))
    assert spec == plain
    stats = scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0  # it did speculate
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # and rolled some back


@pytest.mark.slow
def test_seeded_and_penalised_random_rows_give_the_same_tokens(runner: ModelRunner) -> None:
    options = [
        SamplingOptions(temperature=0.8, seed=7),
        SamplingOptions(temperature=1.0, seed=1, top_k=5, repetition_penalty=1.3),
        SamplingOptions(temperature=0.5, seed=3, frequency_penalty=0.5, min_tokens=6),
        SamplingOptions(temperature=0.0, presence_penalty=0.4),
    ]
    plain, _ = run(runner, PROMPTS, spec=None, options=options)
    spec, scheduler = run(runner, PROMPTS, spec=ngram(4), options=options)
    assert spec == plain
    assert scheduler.spec_stats.num_draft_tokens > 0


@pytest.mark.slow
def test_max_tokens_and_stop_tokens_cut_inside_an_accepted_run(runner: ModelRunner) -> None:
    plain, _ = run(runner, PROMPTS, spec=None, max_tokens=50)
    stops = {r: [plain[r][7]] for r in range(len(PROMPTS))}  # ends at its 8th token or before
    for max_tokens in (5, 11):
        cut, _ = run(runner, PROMPTS, spec=ngram(4), max_tokens=max_tokens)
        assert cut == {r: t[:max_tokens] for r, t in plain.items()}
    stopped, _ = run(runner, PROMPTS, spec=ngram(4), max_tokens=50, stop=stops)
    for rnum, tokens in plain.items():
        end = tokens.index(stops[rnum][0]) + 1
        assert stopped[rnum] == tokens[:end]


@pytest.mark.slow
def test_rollback_at_block_boundaries_caches_only_accepted_tokens(runner: ModelRunner) -> None:
    """Drafts of up to 7 tokens cross 8-token blocks on most steps; a rejected one must not
    leave its block hashed: a second run of the same prompts hits the prefix cache and must
    still give the same tokens."""
    plain, _ = run(runner, PROMPTS, spec=None, max_tokens=40)
    scheduler_tokens, scheduler = run(runner, PROMPTS, spec=ngram(7), max_tokens=40)
    assert scheduler_tokens == plain
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks  # every block went back
    # Each cached block's hash is the hash of accepted tokens only: re-admit prompt + output.
    again = [p + plain[r][:32] for r, p in enumerate(PROMPTS)]
    for rnum, prompt in enumerate(again):
        scheduler.add_request(Request(100 + rnum, prompt, GREEDY, 8))
    tokens: dict[int, list[int]] = {100 + r: [] for r in range(len(again))}
    while scheduler.has_unfinished_requests():
        batch = scheduler.schedule()
        result = scheduler.update_from_output(batch, runner.execute(batch))
        offsets = result.tok_offsets.tolist()
        for i, rnum in enumerate(result.rnums.tolist()):
            tokens[rnum] += result.tokens[offsets[i] : offsets[i + 1]].tolist()
    runner.remove_requests(np.arange(100, 100 + len(again), dtype=np.uint64))
    assert scheduler.prefix_cache_hits > 0
    # After: a second scheduler over the same runner reuses (overwrites) the blocks.
    reference, _ = run(runner, again, spec=None, max_tokens=8)
    assert {r - 100: t for r, t in tokens.items()} == reference


@pytest.mark.slow
def test_preemption_during_speculation_keeps_the_tokens(runner: ModelRunner) -> None:
    """14 blocks for 4 requests that grow to 6 blocks each: they preempt one another while
    drafts are pending; the outputs must not change."""
    plain, _ = run(runner, PROMPTS, spec=None, max_tokens=30)
    spec, scheduler = run(runner, PROMPTS, spec=ngram(4), max_tokens=30, num_blocks=16)
    assert scheduler.num_preemptions > 0
    assert spec == plain


def test_disable_by_batch_size_turns_it_off(runner: ModelRunner) -> None:
    _, scheduler = run(runner, PROMPTS, spec=ngram(3, disable_by_batch_size=2))
    # Four run at first, so the early steps propose nothing; the last two do.
    busy = scheduler.spec_stats.num_drafts
    _, alone = run(runner, PROMPTS, spec=ngram(3))
    assert busy < alone.spec_stats.num_drafts


def test_requests_waiting_count_toward_disable_by_batch_size() -> None:
    def first_step(num_requests: int) -> int:
        scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=64,
                block_size=BLOCK,
                max_num_seqs=1,  # one runs, the others wait
                max_num_batched_tokens=64,
                max_model_len=128,
                speculative=parse_speculative_config(ngram(3, disable_by_batch_size=2)),
            )
        )
        for rnum in range(num_requests):
            scheduler.add_request(Request(rnum, [5, 6, 7], GREEDY, 8))
        return scheduler.schedule().num_speculative_tokens

    assert first_step(2) == 3
    assert first_step(3) == 0


@pytest.mark.slow
def test_the_target_as_its_own_draft_model_accepts_every_draft(tiny_dir: Path) -> None:
    """A check of the draft model's bookkeeping (its KV under the target's block tables,
    the lookahead slots, catch-up after each step): drafting with the target itself, every
    draft is accepted and the tokens are the target's."""
    spec = json.dumps(
        {"method": "draft_model", "model": str(tiny_dir), "num_speculative_tokens": 3}
    )
    drafted = make_runner(tiny_dir, num_blocks=64, block_size=BLOCK, speculative_config=spec)
    plain, _ = run(drafted, PROMPTS, spec=None, max_tokens=30)
    tokens, scheduler = run(drafted, PROMPTS, spec=spec, max_tokens=30)
    assert tokens == plain
    stats = scheduler.spec_stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
