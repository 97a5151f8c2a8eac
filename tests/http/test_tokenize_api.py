"""`/tokenize` with `return_token_strs` and `GET /tokenizer_info`, as vLLM serves them
(vLLM's tests/entrypoints/openai/test_tokenization.py), on the in-process app: the real `App`
and `AsyncLLM` over an in-process engine, no socket."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx

from trillm.engine import EngineConfig, LLMConfig, open_llm
from trillm.engine.client.inputs._tokenizer import load_tokenizer
from trillm.gpu import WorkerConfig
from trillm.http.edge._app import App
from trillm.http.edge._config import ServeConfig
from trillm.http.metrics._metrics import Metrics


@asynccontextmanager
async def app_client(model: Path, config: ServeConfig) -> AsyncIterator[httpx.AsyncClient]:
    worker = WorkerConfig(str(model), device="cpu", dtype="float32", kv_cache_bytes=1 << 25)
    llm_config = LLMConfig(EngineConfig(worker=worker), start_timeout=120, in_process=True)
    async with open_llm(llm_config) as llm:
        app = App(llm, config, Metrics("tiny"))
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://tiny") as client:
            yield client


async def test_return_token_strs_names_each_token(tiny_model: Path) -> None:
    """vLLM's test_tokenize_completions / test_tokenize_chat: `token_strs` with the flag,
    null without it; the strings are the tokenizer's own pieces for the same ids."""
    tokenizer = load_tokenizer(str(tiny_model))
    chat = {"messages": [{"role": "user", "content": "Hi there"}]}
    async with app_client(tiny_model, ServeConfig("tiny")) as client:
        for body in ({"prompt": "Hello world, again"}, chat):
            plain = (await client.post("/tokenize", json=body)).json()
            assert plain["token_strs"] is None
            r = await client.post("/tokenize", json={**body, "return_token_strs": True})
            answer = r.json()
            assert answer["tokens"] == plain["tokens"] and answer["count"] == len(plain["tokens"])
            assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(plain["tokens"])
            assert len(answer["token_strs"]) == answer["count"] > 2
        assert "<|im_start|>" in answer["token_strs"]  # the chat template's own tokens
        r = await client.post("/tokenize", json={"prompt": "x", "return_token_strs": "yes"})
        assert r.status_code == 400 and "return_token_strs" in r.json()["error"]["message"]
        # off by default, as in vLLM (--enable-tokenizer-info-endpoint)
        assert (await client.get("/tokenizer_info")).status_code == 404


async def test_tokenizer_info_reports_the_tokenizer(tiny_model: Path) -> None:
    """vLLM's test_tokenizer_info_basic, _schema, _added_tokens_structure and
    _chat_template: its class, special tokens as text, added tokens by id, the chat template
    served; and none of the server's file paths."""
    tokenizer = load_tokenizer(str(tiny_model))
    config = ServeConfig("tiny", enable_tokenizer_info_endpoint=True)
    async with app_client(tiny_model, config) as client:
        r = await client.get("/tokenizer_info")
        assert r.status_code == 200, r.text
        info = r.json()
        ids = (await client.post("/tokenize", json={"prompt": "<|im_start|>"})).json()["tokens"]
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["bos_token"] == "<|im_start|>" and info["eos_token"] == "<|im_end|>"
    assert info["model_max_length"] == tokenizer.model_max_length
    assert info["chat_template"] == tokenizer.chat_template
    added = info["added_tokens_decoder"]
    assert added[str(ids[0])] == "<|im_start|>" and added["0"] == "<|endoftext|>"
    assert not {"name_or_path", "vocab_file", "merges_file", "tokenizer_file"} & info.keys()
    assert str(tiny_model) not in r.text
