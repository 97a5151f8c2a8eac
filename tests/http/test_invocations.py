"""`POST /invocations` (SageMaker's), routed by the body's shape as vLLM's api_server does
(vLLM's tests/entrypoints/openai/test_chat.py and test_completion.py `test_invocations`: the
same body gives the same answer as the route it stands for)."""

from __future__ import annotations

from pathlib import Path

from trillm.http.edge._config import ServeConfig

from .test_tokenize_api import app_client


async def test_invocations_routes_by_the_bodys_shape(tiny_model: Path) -> None:
    async with app_client(tiny_model, ServeConfig("tiny")) as client:
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "seed": 1}
        completion = {"prompt": "Hello", "max_tokens": 3, "seed": 1}
        for body, route, kind in (
            (chat, "/v1/chat/completions", "chat.completion"),
            (completion, "/v1/completions", "text_completion"),
        ):
            direct = (await client.post(route, json=body)).json()
            r = await client.post("/invocations", json=body)
            assert r.status_code == 200, r.text
            invoked = r.json()
            assert invoked["object"] == direct["object"] == kind
            assert invoked["choices"][0] == direct["choices"][0]  # the same seeded sample
        r = await client.post("/invocations", json={"model": "tiny"})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (
            "an /invocations body needs messages (chat completions), prompt (completions) or "
            "input (embeddings)"
        )
        r = await client.post("/invocations", json={"prompt": 5})  # the route's own words
        assert r.status_code == 400 and "prompt" in r.text
