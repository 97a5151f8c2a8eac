"""`trillm serve DIR --dtype float32` on tiny random models of the new families, through the
official `openai` SDK: the completion is transformers' greedy continuation."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
import transformers

from ..gpu import families
from .conftest import start_server

pytestmark = pytest.mark.timeout(240)
PROMPT = list(range(400, 423))


@pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=pytest.mark.slow) for f in ("gemma3_text", "qwen3_moe")],
)
def test_the_served_completion_is_transformers_greedy_text(family: str, tmp_path: Path) -> None:
    model_dir = families.save(family, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = families.greedy(hf, PROMPT, 12)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(model_dir)
    server = start_server(model_dir, "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        reply = client.completions.create(
            model="tiny",  # conftest.serve_command names it
            prompt=PROMPT,
            max_tokens=12,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
    finally:
        server.stop()
    assert reply.choices[0].text == tokenizer.decode(expected)
    assert reply.usage is not None and reply.usage.completion_tokens == 12
