"""The built-in default model (SmolLM2-135M-Instruct) through the runner, against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from trillm.default_model import default_model_dir, find_default_gguf
from trillm.gpu import SamplingOptions

from .conftest import make_runner
from .driver import Driver, DriverRequest

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "hi",
    "List three primary colours, then explain in two sentences why the sky is blue.",
    "2+2=",
    "Translate 'good morning' to Spanish.",
    "Who wrote Hamlet? Answer in just one word.",
    "Give me a short tip for writing clean Python code, please, with an example.",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return default_model_dir(progress=False)


@pytest.fixture(scope="module")
def chat_prompts(smollm2_dir: Path) -> list[list[int]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = []
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer(text)["input_ids"])
    assert len({len(p) for p in prompts}) == len(prompts)  # all different lengths
    return prompts


def test_greedy_tokens_equal_transformers_generate_for_8_prompts_together(
    smollm2_dir: Path, chat_prompts: list[list[int]]
) -> None:
    runner = make_runner(smollm2_dir, num_blocks=256, block_size=16)
    no_early_eos = SamplingOptions(temperature=0.0, min_tokens=NEW_TOKENS)  # = min_new_tokens
    requests = [DriverRequest(i, p, NEW_TOKENS, no_early_eos) for i, p in enumerate(chat_prompts)]
    Driver(runner, 256, chunk=32).run(requests)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    for request in requests:
        expected = hf.generate(
            torch.tensor([request.prompt]),
            attention_mask=torch.ones(1, len(request.prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )[0, len(request.prompt) :].tolist()
        assert request.output == expected, QUESTIONS[request.rnum]


def test_the_gguf_file_loads_directly_with_the_same_tokens(
    smollm2_dir: Path, chat_prompts: list[list[int]]
) -> None:
    outputs = []
    for model in (smollm2_dir, find_default_gguf()):
        runner = make_runner(model, num_blocks=64, block_size=16)
        requests = [DriverRequest(i, p, 6) for i, p in enumerate(chat_prompts[:2])]
        Driver(runner, 64).run(requests)
        outputs.append([r.output for r in requests])
    assert outputs[0] == outputs[1]
