"""`POST /v1/chat/completions/batch` (vLLM's OpenAIServingChatBatch): N conversations in one
request, choice i conversation i's, each the same as its own chat completion; usage summed;
what a batch cannot take (stream, tools, n > 1, beam search) a 400 naming it; a conversation
that fails fails the batch with its error."""

from __future__ import annotations

from pathlib import Path

from trillm.http.edge._config import ServeConfig

from .test_tokenize_api import app_client

ASKS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}],
    [{"role": "user", "content": "Count to three."}],
]
FIELDS = {"max_tokens": 4, "seed": 7, "logprobs": True, "top_logprobs": 2}


async def test_each_conversation_is_answered_as_its_own_chat_completion(tiny_model: Path) -> None:
    async with app_client(tiny_model, ServeConfig("tiny")) as client:
        alone = []
        for messages in ASKS:
            r = await client.post("/v1/chat/completions", json={"messages": messages, **FIELDS})
            assert r.status_code == 200, r.text
            alone.append(r.json())
        r = await client.post("/v1/chat/completions/batch", json={"messages": ASKS, **FIELDS})
        assert r.status_code == 200, r.text
        batch = r.json()
        assert batch["object"] == "chat.completion"
        assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
        for i, one in enumerate(alone):  # seeded: the same tokens (run in a batch of 3, the
            got, want = batch["choices"][i], one["choices"][0]  # logprobs within float noise)
            assert got["index"] == i and got["message"] == want["message"]
            assert got["finish_reason"] == want["finish_reason"]
            pairs = zip(got["logprobs"]["content"], want["logprobs"]["content"], strict=True)
            for a, b in pairs:
                assert a["token"] == b["token"] and abs(a["logprob"] - b["logprob"]) < 1e-3
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert batch["usage"][key] == sum(one["usage"][key] for one in alone)


async def test_what_a_batch_cannot_take_is_a_400_naming_it(tiny_model: Path) -> None:
    async with app_client(tiny_model, ServeConfig("tiny")) as client:
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        for name, value in (("stream", True), ("n", 2), ("tools", [tool]),
                            ("use_beam_search", True)):  # fmt: skip
            body = {"messages": ASKS, name: value}
            r = await client.post("/v1/chat/completions/batch", json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == name and "is not served in a batch" in error["message"]
        for messages in ([], ASKS[0], "hi"):
            r = await client.post("/v1/chat/completions/batch", json={"messages": messages})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        bad = [ASKS[0], [{"role": "user", "content": 5}]]  # the second fails as chat fails it
        r = await client.post("/v1/chat/completions/batch", json={"messages": bad})
        direct = await client.post("/v1/chat/completions", json={"messages": bad[1]})
        assert r.status_code == direct.status_code == 400
        assert r.json()["error"]["message"] == direct.json()["error"]["message"]
