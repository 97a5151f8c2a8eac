"""`trillm.LLM`: offline batches through the synchronous client, on real engine processes.

Results come back one per prompt, in order, with the tokens `AsyncLLM` generates for the
same prompts; n > 1, logprobs, chat and per-prompt parameters take vLLM's shapes; a death
(SIGKILL, an exception in the forward, a stopped engine) raises `EngineDeadError` naming the
cause instead of hanging; closing leaves no process, no /dev/shm name and no mapping.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import transformers
import trio

from trillm import LLM, CompletionOutput, EmbeddingRequestOutput, RequestOutput
from trillm.engine import EngineConfig, EngineDeadError, EngineStartError, LLMConfig, open_llm
from trillm.engine.client import (
    PoolingType,
    PromptTooLongError,
    SamplingParams,
    SamplingParamsError,
)
from trillm.gpu import WorkerConfig

from ...gpu.conftest import save_tiny
from ...http.conftest import start_server
from ...procs import children, is_dead
from .test_pooling import reference

pytestmark = pytest.mark.timeout(180)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
TINY_ARGS = dict(device="cpu", dtype="float32", kv_cache_bytes=1 << 25, start_timeout=120)
PROMPTS: list[str | list[int]] = [
    "Hello, my name is",
    list(range(100, 130)),
    "The capital of France is",
    [5, 6, 7],
    "Once upon a time, in a land far away, there lived",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("offline-tiny"), "llama")


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> Iterator[LLM]:
    with LLM(str(tiny_dir), **TINY_ARGS) as llm:  # type: ignore[arg-type]
        yield llm


def engine_pid(before: set[int]) -> int:
    (pid,) = set(children(os.getpid())) - before
    return pid


def shm_mapped() -> set[str]:
    """The /dev/shm segments this process maps now."""
    with open("/proc/self/maps") as f:
        return {line.split()[-2] if line.endswith("(deleted)\n") else line.split()[-1]
                for line in f if "/dev/shm/" in line}  # fmt: skip


async def async_tokens(model: Path, prompts: list[str | list[int]]) -> list[list[int]]:
    worker = WorkerConfig(str(model), device="cpu", dtype="float32", kv_cache_bytes=1 << 25)
    async with open_llm(LLMConfig(EngineConfig(worker=worker), start_timeout=120)) as llm:
        return [(await llm.complete(p, GREEDY))[0].token_ids for p in prompts]


def test_results_come_in_order_with_the_tokens_of_async_llm(llm: LLM, tiny_dir: Path) -> None:
    results = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [r.prompt for r in results] == [p if isinstance(p, str) else None for p in PROMPTS]
    assert results[1].prompt_token_ids == PROMPTS[1]
    assert all(isinstance(r, RequestOutput) and r.finished for r in results)
    for r in results:
        (out,) = r.outputs
        assert isinstance(out, CompletionOutput) and out.finished()
        assert len(out.token_ids) == 8 and out.finish_reason == "length"
        assert out.text == llm.get_tokenizer().decode(out.token_ids, skip_special_tokens=True)
        assert out.logprobs is None and out.cumulative_logprob is None
    assert [r.outputs[0].token_ids for r in results] == trio.run(async_tokens, tiny_dir, PROMPTS)
    # one prompt alone (text, or a flat list of ids) is a batch of one
    assert (
        llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids == results[0].outputs[0].token_ids
    )
    alone = llm.generate(PROMPTS[3], GREEDY, use_tqdm=False)  # type: ignore[arg-type]
    assert alone[0].outputs[0].token_ids == results[3].outputs[0].token_ids
    tokens = {"prompt_token_ids": PROMPTS[1]}
    assert llm.generate([tokens], GREEDY)[0].outputs[0].token_ids == results[1].outputs[0].token_ids


def test_embed_gives_transformers_embeddings_in_vllms_shape(llm: LLM, tiny_dir: Path) -> None:
    model = transformers.AutoModel.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    tokenizer = llm.get_tokenizer()
    results = llm.embed(PROMPTS, use_tqdm=False)
    assert all(isinstance(r, EmbeddingRequestOutput) and r.finished for r in results)
    for prompt, result in zip(PROMPTS, results, strict=True):
        ids = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
        assert result.prompt_token_ids == ids
        want = reference(model, ids, PoolingType.LAST)[0]  # LAST and normalised: no ST files
        got = np.asarray(result.outputs.embedding)
        assert got @ want / np.linalg.norm(want) > 0.9999 and abs(np.linalg.norm(got) - 1) < 1e-5
    (cut,) = llm.embed(PROMPTS[4], dimensions=8, truncate_prompt_tokens=4, use_tqdm=False)
    (tail,) = llm.embed([results[4].prompt_token_ids[-4:]], normalize=False, use_tqdm=False)
    assert cut.outputs.hidden_size == 8 and abs(np.linalg.norm(cut.outputs.embedding) - 1) < 1e-5
    want = np.asarray(tail.outputs.embedding[:8])
    assert np.allclose(cut.outputs.embedding, want / np.linalg.norm(want), atol=1e-5)
    with pytest.raises(PromptTooLongError, match=r"513 tokens, more than .* 512"):
        llm.embed([[5] * 513], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be at least 1, got 0"):
        llm.embed("hi", dimensions=0)
    # generation goes on beside it on the same engine
    assert len(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_greedy_text_of_100_prompts_equals_the_servers_in_order(llm: LLM, tiny_dir: Path) -> None:
    prompts = [
        f"{p} {i}" if isinstance(p, str) else [*p, 200 + i] for i in range(20) for p in PROMPTS
    ]
    results = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [r.prompt for r in results] == [p if isinstance(p, str) else None for p in prompts]
    server = start_server(tiny_dir)
    try:
        body = dict(model="tiny", max_tokens=8, temperature=0.0, ignore_eos=True)
        url = f"{server.base_url}/v1/completions"

        def text(client: httpx.Client, prompt: str | list[int]) -> str:
            reply = client.post(url, json={**body, "prompt": prompt})
            return str(reply.json()["choices"][0]["text"])

        # Eight at a time, batched as the offline ones were (one at a time was most of the
        # test's time); map keeps the prompts' order.
        with httpx.Client(timeout=60) as client, ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda p: text(client, p), prompts))
    finally:
        server.stop()
    assert len(results) == 100
    assert [r.outputs[0].text for r in results] == texts
    assert sum(bool(t) for t in texts) >= 60  # (the random model also samples special tokens)


def test_n_gives_several_outputs_and_logprobs_take_vllms_shape(llm: LLM) -> None:
    params = SamplingParams(n=3, seed=7, max_tokens=6, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)  # fmt: skip
    (result,) = llm.generate(["Hello, my name is"], params, use_tqdm=False)
    assert [o.index for o in result.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in result.outputs}) > 1  # seeds 7, 8, 9
    for out in result.outputs:
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 6
        for token, entry in zip(out.token_ids, out.logprobs, strict=True):
            assert token in entry and 2 <= len(entry) <= 3  # the sampled one and the top 2
            assert sorted(lp.rank for lp in entry.values() if lp.rank is not None) == [1, 2]
            assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
        assert out.cumulative_logprob == pytest.approx(
            sum(entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs, strict=True))
        )
    assert result.prompt_logprobs is not None
    assert len(result.prompt_logprobs) == len(result.prompt_token_ids)
    assert result.prompt_logprobs[0] is None
    assert all(t in e for t, e in zip(result.prompt_token_ids[1:], result.prompt_logprobs[1:],
                                      strict=True) if e is not None)  # fmt: skip
    again = llm.generate(["Hello, my name is"], params, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in result.outputs]


def test_chat_renders_each_conversation_with_the_template(llm: LLM) -> None:
    one = [{"role": "user", "content": "What is the capital of France?"}]
    two = [{"role": "user", "content": "Say hello."}]
    (single,) = llm.chat(one, GREEDY, use_tqdm=False)
    both = llm.chat([one, two], GREEDY, use_tqdm=False)
    assert single.prompt is not None and "What is the capital of France?" in single.prompt
    assert single.prompt.rstrip().endswith("assistant")  # ready for the reply
    assert both[0].outputs[0].token_ids == single.outputs[0].token_ids
    assert both[1].prompt is not None and "Say hello." in both[1].prompt
    ids = llm.get_tokenizer()(single.prompt, add_special_tokens=False)["input_ids"]
    assert single.prompt_token_ids == ids


def test_one_sampling_params_per_prompt(llm: LLM) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in (1, 5, 3)]
    results = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    assert [len(r.outputs[0].token_ids) for r in results] == [1, 5, 3]
    stop = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=" ")
    assert llm.generate(["Hello, my name is"], stop)[0].outputs[0].finish_reason in (
        "stop",
        "length",
    )
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts: give one for all"):
        llm.generate(["a", "b", "c"], params[:2])
    with pytest.raises(SamplingParamsError, match="logit_bias token ids must be < vocab_size"):
        llm.generate(["a"], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate([[]], GREEDY)
    assert llm.generate([], GREEDY) == []
    # a refused batch sent nothing: the next one runs as usual
    assert len(llm.generate(["a"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_a_batch_larger_than_the_rings_completes(llm: LLM, tiny_dir: Path) -> None:
    """64 ADDs (~13 KB) through a 4 KiB request ring and STEPs through a 16 KiB output ring:
    while the request ring is full the client reads outputs, so neither side waits forever."""
    prompts = [list(range(200 + 7 * i, 230 + 7 * i)) for i in range(64)]
    expected = [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY, use_tqdm=False)]
    small = dict(TINY_ARGS, request_ring_bytes=1 << 12, output_ring_bytes=1 << 14)
    with LLM(str(tiny_dir), **small) as cramped:  # type: ignore[arg-type]
        got = cramped.generate(prompts, GREEDY, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in got] == expected


def test_bad_engine_args_are_refused_before_any_process_starts(tiny_dir: Path) -> None:
    before = set(children(os.getpid()))
    with pytest.raises(TypeError, match=r"unexpected engine argument 'max_num_seq'; the engine "
                       r"arguments are: .*max_num_seqs"):  # fmt: skip
        LLM(str(tiny_dir), max_num_seq=4)
    with pytest.raises(ValueError, match="max_num_seqs must be positive, got 0"):
        LLM(str(tiny_dir), max_num_seqs=0)
    with pytest.raises(ValueError, match="dtype 'float8' is not auto or one of"):
        LLM(str(tiny_dir), dtype="float8")
    assert set(children(os.getpid())) == before
    with pytest.raises(EngineStartError, match="the engine failed to start"):
        LLM(str(tiny_dir / "missing"), **TINY_ARGS)  # type: ignore[arg-type]
    assert all(is_dead(pid) for pid in set(children(os.getpid())) - before)


def test_sigkill_during_generate_raises_engine_dead_naming_the_signal(tiny_dir: Path) -> None:
    before = set(children(os.getpid()))
    # The null executor's 50 ms steps keep the batch running for 24 s on any machine.
    slow = dict(TINY_ARGS, executor="null", null_step_time=0.05)
    long = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
    with LLM(str(tiny_dir), **slow) as llm:  # type: ignore[arg-type]
        pid = engine_pid(before)
        killed_at: list[float] = []

        def kill() -> None:
            killed_at.append(time.monotonic())
            os.kill(pid, signal.SIGKILL)

        killer = threading.Timer(1.0, kill)
        killer.start()
        try:
            with pytest.raises(
                EngineDeadError, match=r"engine process killed by signal 9 \(SIGKILL\)"
            ):
                llm.generate(["a", "b", "c"], long, use_tqdm=False)
        finally:
            killer.join()
        assert time.monotonic() - killed_at[0] < 10  # noticed at once, not at the batch's end
        assert is_dead(pid)
        with pytest.raises(EngineDeadError, match="killed by signal 9"):  # every later call
            llm.generate(["a"], GREEDY)
    llm.close()  # a second close does nothing


POISON = 49000  # the hook raises in every step whose input holds this token


def test_an_exception_in_the_engine_is_the_named_root_cause(tiny_dir: Path) -> None:
    with LLM(str(tiny_dir), inject_fault=f"token:0:{POISON}", **TINY_ARGS) as llm:  # type: ignore[arg-type]
        assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        with pytest.raises(EngineDeadError, match="InjectedFault in worker rank 0") as caught:
            llm.generate([[1, 2, 3], [4, POISON, 6]], GREEDY, use_tqdm=False)
        assert caught.value.__cause__ is not None  # the engine's traceback


def test_a_stopped_engine_is_declared_dead_by_the_watchdog(tiny_dir: Path) -> None:
    before = set(children(os.getpid()))
    slow = dict(TINY_ARGS, executor="null", null_step_time=0.05, watchdog_timeout=1.0)
    long = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
    with LLM(str(tiny_dir), **slow) as llm:  # type: ignore[arg-type]
        pid = engine_pid(before)
        threading.Timer(0.5, os.kill, (pid, signal.SIGSTOP)).start()
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"no heartbeat from the engine process \(pid "):
            llm.generate(["a"], long, use_tqdm=False)
        assert time.monotonic() - started < 12
    assert is_dead(pid)


def test_close_leaves_no_process_no_name_and_no_mapping(tiny_dir: Path) -> None:
    before, mapped = set(children(os.getpid())), shm_mapped()
    llm = LLM(str(tiny_dir), **TINY_ARGS)  # type: ignore[arg-type]
    pid = engine_pid(before)
    assert shm_mapped() - mapped  # the two rings
    assert llm.generate(["a"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    started = time.monotonic()
    llm.close()
    assert time.monotonic() - started < 30
    assert is_dead(pid) and not set(children(os.getpid())) - before
    assert shm_mapped() <= mapped
    mine = (f"trillm-{os.getpid()}-", f"trillm-{pid}-")
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(mine)]
    llm.close()  # idempotent
    with pytest.raises(trio.ClosedResourceError, match="this LLM was closed: make a new"):
        llm.generate(["a"], GREEDY)
