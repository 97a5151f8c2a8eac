"""LoRA over HTTP: `model` names an adapter, /v1/models lists it with its parent, and the
runtime routes (behind --enable-runtime-lora-updating) load and unload; a bad adapter is a
400 naming why, and the server serves on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import transformers

from ..gpu.lora_adapters import edit_config, make_adapter, merged_greedy
from .conftest import Server, start_server

pytestmark = pytest.mark.timeout(300)
PROMPT = list(range(100, 121))


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("http-adapters")
    return {
        "sql": make_adapter(tiny_model, root / "sql", seed=1),
        "chat": make_adapter(tiny_model, root / "chat", seed=2, r=16),
    }


@pytest.fixture(scope="module")
def lora_server(tiny_model: Path, adapters: dict[str, Path]) -> Iterator[Server]:
    server = start_server(
        tiny_model,
        "--enable-lora",
        "--max-loras", "2",
        "--lora-modules", f"sql={adapters['sql']}",
        "--enable-runtime-lora-updating",
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


def complete(server: Server, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)


def test_requests_pick_an_adapter_by_model_and_models_lists_it(
    lora_server: Server, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    models = httpx.get(f"{lora_server.base_url}/v1/models").json()["data"]
    cards = {card["id"]: card for card in models}
    assert cards["sql"]["parent"] == models[0]["id"]  # the served model
    assert cards["sql"]["root"] == "sql"  # never the server's path (--enable-dev-endpoints)
    assert models[0]["root"] == models[0]["id"]  # started from a path: its name stands for it
    sdk = openai.OpenAI(base_url=f"{lora_server.base_url}/v1", api_key="x", max_retries=0)
    one = sdk.models.retrieve("sql").model_dump(exclude_none=True, exclude={"created"})
    assert one == {k: v for k, v in cards["sql"].items() if k != "created"}
    assert sdk.models.retrieve(models[0]["id"]).id == models[0]["id"]
    with pytest.raises(openai.NotFoundError, match="the model 'chat'"):
        sdk.models.retrieve("chat")  # not loaded (yet)
    got = complete(lora_server, "sql").json()["choices"][0]["text"]
    want = merged_greedy(tiny_model, adapters["sql"], PROMPT, 6)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model)
    assert got == tokenizer.decode(want)
    assert complete(lora_server, "nope").status_code == 404


def test_runtime_load_and_unload(
    lora_server: Server, tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    url = lora_server.base_url
    loaded = httpx.post(
        f"{url}/v1/load_lora_adapter",
        json={"lora_name": "chat", "lora_path": str(adapters["chat"])},
        timeout=60,
    )
    assert loaded.status_code == 200, loaded.text
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model)
    want = tokenizer.decode(merged_greedy(tiny_model, adapters["chat"], PROMPT, 6))
    assert complete(lora_server, "chat").json()["choices"][0]["text"] == want
    again = httpx.post(
        f"{url}/v1/load_lora_adapter",
        json={"lora_name": "chat", "lora_path": str(adapters["chat"])},
    )
    assert again.status_code == 400 and "loaded already" in again.text
    bad = make_adapter(tiny_model, tmp_path / "bad", seed=3)
    edit_config(bad, target_modules=["lm_head"])
    refused = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)}
    )
    assert refused.status_code == 400
    assert (
        "LoRA adapter 'bad': unsupported target modules ['lm_head']"
        in refused.json()["error"]["message"]
    )
    (bad / "adapter_model.safetensors").rename(bad / "adapter_model.bin")
    refused = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)}
    )
    assert refused.status_code == 400
    assert "a pickled adapter_model.bin is never loaded" in refused.text
    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert unloaded.status_code == 200, unloaded.text
    assert complete(lora_server, "chat").status_code == 404
    assert (
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 404
    )
    assert complete(lora_server, "sql").status_code == 200  # serving on


def test_an_adapter_never_takes_the_served_models_name_nor_a_path_past_path_max(
    lora_server: Server, adapters: dict[str, Path]
) -> None:
    """Issue 46, findings 4 and 8: a runtime adapter named as the served model would have run
    every tenant's base-model requests through it; a 5,000-character path is refused at the
    edge, before the engine sees it."""
    url = lora_server.base_url
    served = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"lora_name": served, "lora_path": str(adapters["chat"])}
    taken = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)
    assert taken.status_code == 400
    assert f"lora_name {served!r} is the served model's name" in taken.json()["error"]["message"]
    long = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "long", "lora_path": "/x" * 2500}
    )
    assert long.status_code == 400 and "length <= 4096" in long.text
    named = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "n" * 300, "lora_path": "/x"}
    )
    assert named.status_code == 400 and "length <= 256" in named.text
    models = {card["id"] for card in httpx.get(f"{url}/v1/models").json()["data"]}
    assert "long" not in models and served in models
    assert complete(lora_server, served).status_code == 200


def test_a_start_up_adapter_named_as_the_served_model_is_refused(tmp_path: Path) -> None:
    from trillm.common.wire import LoraModule
    from trillm.gpu import WorkerConfig
    from trillm.http import build_config

    worker = WorkerConfig(str(tmp_path), enable_lora=True)
    with pytest.raises(ValueError, match="adapter name 'm' is the served model's name"):
        build_config(worker=worker, served_model_name="m", lora_modules=(LoraModule("m", "/a"),))
