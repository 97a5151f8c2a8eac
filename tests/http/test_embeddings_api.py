"""The pooling routes served by `trillm serve`: /v1/embeddings through the openai SDK and
LangChain, /pooling, /score, /rerank, their 400s naming the field, and the metrics."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers

from .conftest import Server, start_server

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France."]


@pytest.fixture(scope="module")
def pool_server(tiny_model: Path) -> Iterator[Server]:
    server = start_server(tiny_model, "--max-model-len", "64")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModel.from_pretrained(tiny_model, dtype=torch.float32).eval()


def expected(model: transformers.PreTrainedModel, tiny_model: Path, text: str) -> np.ndarray:
    """transformers' last hidden state of the last token, normalised (LAST, normalize)."""
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(tiny_model)
    with torch.no_grad():
        hidden = model(torch.tensor([tokenizer(text)["input_ids"]])).last_hidden_state[0, -1]
    vector = hidden.numpy()
    return vector / np.linalg.norm(vector)


def cosine(a: list[float] | np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, np.float32)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_the_openai_sdk_gets_transformers_embeddings(
    pool_server: Server, reference: transformers.PreTrainedModel, tiny_model: Path
) -> None:
    client = openai.OpenAI(base_url=f"{pool_server.base_url}/v1", api_key="none")
    result = client.embeddings.create(model="tiny", input=TEXTS)
    assert [d.index for d in result.data] == [0, 1]
    for text, item in zip(TEXTS, result.data, strict=True):
        assert cosine(item.embedding, expected(reference, tiny_model, text)) >= 0.9999
        assert abs(np.linalg.norm(item.embedding) - 1) < 1e-5
    assert result.usage.prompt_tokens > 0 and result.model == "tiny"
    # The SDK asks for base64 unless told (and decodes it); asked for it, it hands it over.
    raw = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="base64")
    one = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float")
    decoded = np.frombuffer(base64.b64decode(str(raw.data[0].embedding)), "<f4")
    assert np.allclose(decoded, one.data[0].embedding, atol=1e-6)
    cut = client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=16)
    vector = np.asarray(cut.data[0].embedding)
    assert len(vector) == 16 and abs(np.linalg.norm(vector) - 1) < 1e-5
    assert cosine(vector, np.asarray(one.data[0].embedding[:16])) >= 0.9999


def test_langchain_embeds_documents(pool_server: Server) -> None:
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        model="tiny",
        base_url=f"{pool_server.base_url}/v1",
        api_key="none",  # type: ignore[arg-type]
        check_embedding_ctx_length=False,
    )
    vectors = embeddings.embed_documents(TEXTS)
    query = embeddings.embed_query(TEXTS[0])
    assert len(vectors) == 2 and len(vectors[0]) == 64
    assert cosine(query, np.asarray(vectors[0])) >= 0.9999


def test_token_id_inputs_and_base64(pool_server: Server) -> None:
    url = f"{pool_server.base_url}/v1/embeddings"
    ids = httpx.post(url, json={"input": [[5, 6, 7], [8, 9]]}).json()
    one = httpx.post(url, json={"input": [5, 6, 7], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(one["data"][0]["embedding"]), "<f4")
    assert np.allclose(decoded, ids["data"][0]["embedding"], atol=1e-6)
    assert ids["usage"] == {"prompt_tokens": 5, "total_tokens": 5}


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": []}, "input", "input is empty"),
        ({"input": ""}, "input", "empty string"),
        ({"input": [1.5]}, "input", "must be a string or a list of token ids"),
        ({"input": 3}, "input", "invalid input"),
        ({"input": list(range(3, 70))}, "input", "67 tokens, more than the model's maximum"),
        ({"input": "hi", "dimensions": 65}, "dimensions", "more than the model's embedding"),
        ({"input": "hi", "dimensions": 0}, "dimensions", "at least 1"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "invalid"),
    ],
)
def test_bad_inputs_are_400s_naming_the_field(
    pool_server: Server, body: dict[str, object], param: str, message: str
) -> None:
    url = f"{pool_server.base_url}/v1/embeddings"
    httpx.post(url, json={"input": "learn the embedding size"}).raise_for_status()
    response = httpx.post(url, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_a_cut_input_fits(pool_server: Server) -> None:
    url = f"{pool_server.base_url}/v1/embeddings"
    long = list(range(3, 70))
    cut = httpx.post(url, json={"input": long, "truncate_prompt_tokens": 64}).json()
    tail = httpx.post(url, json={"input": long[-64:]}).json()
    assert cut["usage"]["prompt_tokens"] == 64
    assert np.allclose(cut["data"][0]["embedding"], tail["data"][0]["embedding"], atol=1e-5)


def test_pooling_score_and_rerank(pool_server: Server) -> None:
    base = pool_server.base_url
    pooled = httpx.post(f"{base}/pooling", json={"input": TEXTS}).json()
    assert pooled["data"][1]["object"] == "pooling" and len(pooled["data"][1]["data"]) == 64
    a, b = (np.asarray(d["data"]) for d in pooled["data"])
    score = httpx.post(f"{base}/score", json={"text_1": TEXTS[0], "text_2": TEXTS}).json()
    assert [d["index"] for d in score["data"]] == [0, 1]
    assert abs(score["data"][0]["score"] - 1) < 1e-5
    assert abs(score["data"][1]["score"] - float(a @ b)) < 1e-5
    pairs = httpx.post(f"{base}/score", json={"text_1": TEXTS, "text_2": TEXTS[::-1]}).json()
    assert abs(pairs["data"][0]["score"] - float(a @ b)) < 1e-5
    rerank = httpx.post(
        f"{base}/rerank", json={"query": TEXTS[1], "documents": TEXTS, "top_n": 1}
    ).json()
    assert [r["index"] for r in rerank["results"]] == [1]
    assert rerank["results"][0]["document"] == {"text": TEXTS[1]}
    bad = httpx.post(f"{base}/score", json={"text_1": TEXTS, "text_2": TEXTS[:1] * 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
    metrics = httpx.get(f"{base}/metrics").text
    assert 'trillm:pooling_requests_total{endpoint="rerank",model_name="tiny"} 3.0' in metrics


def test_a_cache_salt_isolates_embeddings_tenants(pool_server: Server) -> None:
    """LAST pooling reads cached blocks, so embeddings take vLLM's cache_salt too: the same
    input hits the prefix cache within one salt and never across salts (the hit counter)."""

    def hits() -> float:
        metrics = httpx.get(f"{pool_server.base_url}/metrics", timeout=30).text
        line = next(x for x in metrics.splitlines() if x.startswith("vllm:prefix_cache_hits_total"))
        return float(line.rsplit(" ", 1)[1])

    url, ids = f"{pool_server.base_url}/v1/embeddings", list(range(200, 241))  # 2 full blocks
    for salt, hit in [("tenant-a", 0), ("tenant-a", 32), ("tenant-b", 0), (None, 0), (None, 32)]:
        before = hits()
        body = {"input": ids} if salt is None else {"input": ids, "cache_salt": salt}
        assert httpx.post(url, json=body, timeout=60).status_code == 200
        assert hits() - before == hit, salt
    empty = httpx.post(url, json={"input": ids, "cache_salt": ""}, timeout=60)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "cache_salt"


def test_add_special_tokens_false_leaves_the_text_bare(pool_server: Server) -> None:
    url = f"{pool_server.base_url}/v1/embeddings"
    text = TEXTS[0]
    bare = httpx.post(url, json={"input": text, "add_special_tokens": False}).json()
    ids = httpx.post(
        f"{pool_server.base_url}/tokenize", json={"prompt": text, "add_special_tokens": False}
    ).json()["tokens"]
    same = httpx.post(url, json={"input": ids}).json()
    assert bare["usage"]["prompt_tokens"] == len(ids)
    assert np.allclose(bare["data"][0]["embedding"], same["data"][0]["embedding"], atol=1e-6)
