"""Structured outputs end to end through a real engine process (the tiny random model, whose
free choice would be noise: only the mask can make its output valid)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import jsonschema
import pytest
import trio

from trillm.engine import (
    AsyncLLM,
    EngineConfig,
    LLMConfig,
    RequestFailedError,
    SamplingParams,
    StructuredOutputError,
    StructuredOutputs,
    open_llm,
)
from trillm.gpu import WorkerConfig

from ...gpu.conftest import save_tiny

# Bounded in every direction, so a random model must finish it within max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 6},
            "minItems": 1,
            "maxItems": 3,
        },
        "manager": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 8}]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "manager", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("structured-tiny"), "llama")


def config(
    model: Path,
    *,
    kv_bytes: int = 1 << 25,
    timeout: float = 10.0,
    max_model_len: int = 512,
    in_process: bool = False,
) -> LLMConfig:
    worker = WorkerConfig(
        str(model),
        device="cpu",
        dtype="float32",
        block_size=16,
        kv_cache_bytes=kv_bytes,
        max_model_len=max_model_len,
    )
    return LLMConfig(
        EngineConfig(worker=worker, structured_outputs_timeout=timeout), in_process=in_process
    )


@pytest.fixture(params=["split", "in_process"])
async def llm(tiny_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[AsyncLLM]:
    """The engine in its own process, and in this one (the same tests for both)."""
    async with open_llm(config(tiny_dir, in_process=request.param == "in_process")) as llm:
        yield llm


# A split engine is a process start per test; the in-process engine runs the same client,
# rings, checker and engine core. The longest generations run split in `make test-slow` only;
# split in `make test` stay the cut by max_tokens, the refused schema, the preemption and the
# engine's compile timeout (and tests/http/test_structured_http.py through a served engine).
SPLIT_SLOW = [pytest.param("split", marks=pytest.mark.slow), "in_process"]


def params(constraint: StructuredOutputs, **kw: object) -> SamplingParams:
    kw.setdefault("max_tokens", 400)
    return SamplingParams(structured_outputs=constraint, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("llm", SPLIT_SLOW, indirect=True)
async def test_json_schema_outputs_validate_streamed_and_not(llm: AsyncLLM) -> None:
    constraint = StructuredOutputs(json=PERSON)
    for seed in range(3):
        (whole,) = await llm.complete("A person:", params(constraint, seed=seed))
        assert whole.finish_reason == "stop", whole.text
        jsonschema.validate(json.loads(whole.text), PERSON)
    text = ""
    async with llm.generate("A person:", params(constraint, seed=0)) as stream:
        async for output in stream:
            text += output.text
            finish = output.finish_reason
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("llm", SPLIT_SLOW, indirect=True)
async def test_n_children_with_seeds_logprobs_and_penalties_follow_the_grammar(
    llm: AsyncLLM,
) -> None:
    outputs = await llm.complete(
        "People:",
        params(
            StructuredOutputs(json=PERSON),
            n=4,
            seed=11,
            logprobs=2,
            presence_penalty=1.0,
            repetition_penalty=1.3,
        ),
    )
    assert len({o.text for o in outputs}) > 1
    for output in outputs:
        jsonschema.validate(json.loads(output.text), PERSON)
        assert output.logprobs is not None and len(output.logprobs) == len(output.token_ids)


@pytest.mark.parametrize("llm", SPLIT_SLOW, indirect=True)
async def test_regex_choice_grammar_and_json_object(llm: AsyncLLM) -> None:
    (phone,) = await llm.complete("Call", params(StructuredOutputs(regex=r"\d{3}-\d{4}")))
    assert re.fullmatch(r"\d{3}-\d{4}", phone.text) and phone.finish_reason == "stop"
    (pick,) = await llm.complete("Pick", params(StructuredOutputs(choice=["red", "green"])))
    assert pick.text in ("red", "green")
    lark = 'start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/'
    (assign,) = await llm.complete("Set", params(StructuredOutputs(grammar=lark)))
    assert re.fullmatch(r"x=[0-9]{1,3};", assign.text)
    (obj,) = await llm.complete(
        "{", params(StructuredOutputs(json_object=True), max_tokens=30, temperature=0)
    )
    assert obj.text.startswith("{")  # may be cut by max_tokens: then "length", never prose
    assert obj.finish_reason in ("stop", "length")


async def test_max_tokens_cuts_a_grammar_with_length(llm: AsyncLLM) -> None:
    (out,) = await llm.complete(
        "Digits", params(StructuredOutputs(regex=r"[0-9]{50}"), max_tokens=5, ignore_eos=True)
    )
    assert out.finish_reason == "length" and re.fullmatch(r"[0-9]+", out.text)


@pytest.mark.parametrize("llm", SPLIT_SLOW, indirect=True)
async def test_structured_and_free_requests_share_batches(llm: AsyncLLM) -> None:
    free = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)
    results: dict[str, object] = {}

    async def run(name: str, p: SamplingParams) -> None:
        results[name] = (await llm.complete("Mixed", p))[0]

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(run, f"free{i}", free)
            nursery.start_soon(run, f"json{i}", params(StructuredOutputs(json=PERSON), seed=i))
    for i in range(4):
        jsonschema.validate(json.loads(results[f"json{i}"].text), PERSON)  # type: ignore[attr-defined]
        assert len(results[f"free{i}"].token_ids) == 20  # type: ignore[attr-defined]


async def test_preemption_keeps_the_grammar_state(tiny_dir: Path) -> None:
    """A KV cache of 8 blocks of 16 tokens for 6 requests of ~100 tokens: requests are
    preempted and recomputed, and each output still validates."""
    # 2 layers x 2 kv heads x 16 dim x 4 bytes x 2 (K, V) x 16 tokens = 8 KiB per block.
    # In process: preemption is the engine core's, the same on a thread (no process start).
    cramped = config(tiny_dir, kv_bytes=8 * 8192, max_model_len=128, in_process=True)
    async with open_llm(cramped) as llm:
        outputs: list[str] = []

        async def one(seed: int) -> None:
            constraint = StructuredOutputs(json=PERSON)
            (out,) = await llm.complete("P", params(constraint, seed=seed, max_tokens=120))
            outputs.append(out.text)

        async with trio.open_nursery() as nursery:
            for seed in range(6):
                nursery.start_soon(one, seed)
        stats = await llm.utility("stats")
    assert isinstance(stats, dict) and stats["num_preemptions"] > 0
    for text in outputs:
        jsonschema.validate(json.loads(text), PERSON)


async def test_a_bad_schema_is_refused_before_the_engine_and_the_engine_goes_on(
    llm: AsyncLLM,
) -> None:
    bad = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "nope"}}})
    with pytest.raises(StructuredOutputError, match=r"invalid structured_outputs\.json"):
        await llm.complete("x", params(bad))
    (ok,) = await llm.complete("x", params(StructuredOutputs(choice=["fine"])))
    assert ok.text == "fine"


async def test_an_engine_compile_past_its_timeout_fails_only_that_request(
    tiny_dir: Path,
) -> None:
    """The engine's own deadline, the frontend's check passed (its checker is given a
    generous one here): the request fails alone, naming the flag, and the engine goes on."""
    from trillm.engine.client.inputs._structured import GrammarChecker, build_ll_tokenizer

    # In process: the deadline is the engine core's, the same on a thread (no process start).
    async with open_llm(config(tiny_dir, timeout=1e-9, in_process=True)) as llm:
        tokenizer, vocab = llm.tokenizer, llm.ready.vocab_size
        llm._structured.checker = GrammarChecker(
            lambda: build_ll_tokenizer(tokenizer, vocab), timeout=60
        )
        # Tens of ms to compile: far past the deadline at the engine's first poll (2 ms).
        wide = {f"p{i}": {"type": "object", "properties": {
            f"q{j}": {"type": "integer", "minimum": j, "maximum": 1000 + j} for j in range(30)
        }} for i in range(60)}  # fmt: skip
        slow = StructuredOutputs(json={"type": "object", "properties": wide})
        with pytest.raises(RequestFailedError, match="--structured-outputs-timeout"):
            await llm.complete("y", params(slow))
        (free,) = await llm.complete("z", SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(free.token_ids) == 3
        assert not llm.errored


@pytest.mark.slow
async def test_tensor_parallel_2_follows_the_grammar_like_one_rank(tiny_dir: Path) -> None:
    """At TP 2 the bitmask rides in the step's broadcast record to both ranks; greedy, the
    tokens equal TP 1's."""
    constraint = StructuredOutputs(json=PERSON)
    greedy = params(constraint, temperature=0)
    async with open_llm(config(tiny_dir)) as llm:
        (one,) = await llm.complete("TP", greedy)
    tp2 = config(tiny_dir)
    tp2 = LLMConfig(
        EngineConfig(worker=tp2.engine.worker, tensor_parallel_size=2), start_timeout=240
    )
    async with open_llm(tp2) as llm:
        (two,) = await llm.complete("TP", greedy)
        (seeded,) = await llm.complete("TP", params(constraint, seed=3))
    jsonschema.validate(json.loads(two.text), PERSON)
    jsonschema.validate(json.loads(seeded.text), PERSON)
    assert two.token_ids == one.token_ids
