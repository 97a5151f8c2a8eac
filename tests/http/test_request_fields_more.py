"""No request field is silently ignored (issue 47), for the request Structs that
test_request_fields.py leaves out: the Responses API's (`ResponsesRequest` and the Structs
nested in it), the pooling routes' (`EmbeddingRequest`, `ScoreRequest`, `RerankRequest`) and
the tokenizer routes' (`TokenizeRequest`, `DetokenizeRequest`).

Each field either shows its effect in a live response or is a 400 whose `param` names it.
`CHECKS` maps each (Struct, field) to a check; `test_every_request_field_has_a_check`
compares it with `msgspec.structs.fields`, so a field added later without a check fails.
Annotations that change no output by their definition (`user`, `metadata`, an input item's
`id`) are checked to be echoed or typed: taken as sent, refused otherwise. Where a check
mirrors one of vLLM's tests (tests/entrypoints/openai), its docstring names it.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import transformers

from trillm.http.openai import _requests as R
from trillm.http.pooling import _schema as P
from trillm.http.responses import _api as A

from .conftest import Server, start_server

ASK = "Tell me a saying."
GREEDY = {"temperature": 0, "max_output_tokens": 12}
TOOL = {"type": "function", "name": "ping", "parameters": {"type": "object"}}
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France."]


@pytest.fixture(scope="module")
def live(tiny_model: Path) -> Iterator[Server]:
    server = start_server(tiny_model)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reasoner(tiny_model: Path) -> Iterator[Server]:
    """The `reasoning` fields are served under a reasoning parser (without one they are a
    400 naming `reasoning`); qwen3's finds no reasoning in the tiny model's text."""
    server = start_server(tiny_model, "--reasoning-parser", "qwen3")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(tiny_model)


def post(s: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{s.base_url}{path}", json=body, timeout=60)


def ok(s: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = post(s, path, body)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def refused(s: Server, path: str, param: str, body: dict[str, Any]) -> str:
    r = post(s, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    return str(error["message"])


# -- the Responses API ---------------------------------------------------------------------


def resp(s: Server, **fields: Any) -> dict[str, Any]:
    return ok(s, "/v1/responses", {"input": ASK, **fields})


def resp_refused(s: Server, param: str, **fields: Any) -> str:
    return refused(s, "/v1/responses", param, {"input": ASK, **fields})


def out_text(body: dict[str, Any]) -> str:
    return "".join(
        p["text"] for i in body["output"] if i["type"] == "message" for p in i["content"]
    )


def input_tokens(s: Server, **fields: Any) -> int:
    return int(resp(s, max_output_tokens=1, **fields)["usage"]["input_tokens"])


def calls(body: dict[str, Any]) -> list[str]:
    return [i["name"] for i in body["output"] if i["type"] == "function_call"]


def echoed(name: str, value: Any, wrong: Any) -> Callable[[Server], None]:
    """An annotation: echoed as sent, refused when it is not of its type."""

    def check(s: Server) -> None:
        assert resp(s, max_output_tokens=1, **{name: value})[name] == value
        resp_refused(s, name, **{name: wrong})

    return check


def check_model(s: Server) -> None:
    assert resp(s, model="tiny", max_output_tokens=1)["model"] == "tiny"
    assert post(s, "/v1/responses", {"input": ASK, "model": "not-served"}).status_code == 404


def check_input(s: Server) -> None:
    assert input_tokens(s, input="Hi " * 20) > input_tokens(s, input="Hi")
    resp_refused(s, "input", input=[])
    assert refused(s, "/v1/responses", "input", {}) == "input is required"


def check_instructions(s: Server) -> None:
    """The system message (in place of the template's default one)."""
    body = resp(s, max_output_tokens=1, instructions="Answer in French.")
    assert body["instructions"] == "Answer in French."
    longer = "Answer in French, and in one short sentence only."
    assert input_tokens(s, instructions=longer) > body["usage"]["input_tokens"]


def check_tools(s: Server) -> None:
    """vLLM's responses/test_function_call.py: a required call of the one tool sent."""
    body = resp(s, max_output_tokens=48, temperature=0, tools=[TOOL], tool_choice="required")
    assert calls(body)[:1] == ["ping"]
    resp_refused(s, "tools[0].type", tools=[{"type": "web_search"}])


def check_tool_choice(s: Server) -> None:
    named = {"type": "function", "name": "ping"}
    assert calls(resp(s, max_output_tokens=48, temperature=0, tools=[TOOL], tool_choice=named))
    assert not calls(resp(s, max_output_tokens=8, tools=[TOOL], tool_choice="none"))
    resp_refused(s, "tool_choice", tool_choice={"type": "file_search"})


def check_parallel_tool_calls(s: Server) -> None:
    """false: one call at most (the grammar closes after it), however many tools are sent."""
    tools = [TOOL, {**TOOL, "name": "pong"}]
    for _ in range(3):
        body = resp(s, max_output_tokens=96, temperature=1.0, tools=tools,
                    tool_choice="required", parallel_tool_calls=False)  # fmt: skip
        assert len(calls(body)) == 1 and body["parallel_tool_calls"] is False


SCHEMA = {"enum": ["alpha", "beta"]}
FORMAT = {"type": "json_schema", "name": "pick", "schema": SCHEMA}


def check_text(s: Server) -> None:
    """vLLM's responses/test_structured_output.py: the text follows the schema."""
    body = resp(s, max_output_tokens=12, text={"format": FORMAT})
    assert json.loads(out_text(body)) in SCHEMA["enum"]
    assert body["text"]["format"]["name"] == "pick"


def check_reasoning(s: Server) -> None:
    assert resp(s, max_output_tokens=1, reasoning={"effort": "low"})["reasoning"]["effort"] == "low"
    resp_refused(s, "reasoning.effort", reasoning={"effort": "extreme"})


def check_max_output_tokens(s: Server) -> None:
    body = resp(s, temperature=0, max_output_tokens=3)
    assert body["usage"]["output_tokens"] == 3 and body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}


def check_temperature(s: Server) -> None:
    assert out_text(resp(s, **GREEDY)) == out_text(resp(s, **GREEDY))
    hot = {**GREEDY, "temperature": 100}
    assert len({out_text(resp(s, **hot)) for _ in range(3)}) > 1


def check_top_p(s: Server) -> None:
    greedy = out_text(resp(s, **GREEDY))
    for _ in range(2):
        assert out_text(resp(s, **{**GREEDY, "temperature": 100}, top_p=1e-9)) == greedy


def sse(s: Server, **fields: Any) -> list[dict[str, Any]]:
    r = post(s, "/v1/responses", {"input": ASK, "stream": True, **fields})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return [
        json.loads(line.removeprefix("data: "))
        for event in r.text.split("\n\n")
        for line in event.split("\n")
        if line.startswith("data: ")
    ]


def check_stream(s: Server) -> None:
    """vLLM's responses/test_streaming_events.py: the deltas make the text."""
    events = sse(s, **GREEDY)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == out_text(resp(s, **GREEDY))
    assert events[-1]["type"] == "response.incomplete"


def check_stream_options(s: Server) -> None:
    resp_refused(s, "stream_options", stream_options={"include_obfuscation": False})
    assert sse(s, max_output_tokens=1, stream_options={"include_obfuscation": False})


def stored(s: Server, response_id: str) -> int:
    return httpx.get(f"{s.base_url}/v1/responses/{response_id}", timeout=30).status_code


def check_store(s: Server) -> None:
    """vLLM's responses/test_store.py: store false keeps nothing to get."""
    assert stored(s, resp(s, max_output_tokens=1)["id"]) == 200
    unkept = resp(s, max_output_tokens=1, store=False)
    assert unkept["store"] is False and stored(s, unkept["id"]) == 404


def check_previous_response_id(s: Server) -> None:
    first = resp(s, max_output_tokens=4)
    after = resp(s, max_output_tokens=1, input="And another.", previous_response_id=first["id"])
    assert after["previous_response_id"] == first["id"]
    assert after["usage"]["input_tokens"] > input_tokens(s, input="And another.")
    r = post(s, "/v1/responses", {"input": ASK, "previous_response_id": "resp_none"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def check_service_tier(s: Server) -> None:
    assert resp(s, max_output_tokens=1, service_tier="auto")["service_tier"] == "default"
    resp_refused(s, "service_tier", service_tier="flex")


def check_include(s: Server) -> None:
    body = resp(s, **GREEDY, include=["message.output_text.logprobs"])
    parts = [p for i in body["output"] if i["type"] == "message" for p in i["content"]]
    assert sum(len(p["logprobs"]) for p in parts) == 12
    resp_refused(s, "include[0]", include=["file_search_call.results"])


def check_truncation(s: Server) -> None:
    assert resp(s, max_output_tokens=1, truncation="disabled")["truncation"] == "disabled"
    assert "never drops input" in resp_refused(s, "truncation", truncation="auto")


def check_top_logprobs(s: Server) -> None:
    body = resp(s, **GREEDY, top_logprobs=3)
    lps = [e for i in body["output"] if i["type"] == "message" for p in i["content"]
           for e in p["logprobs"]]  # fmt: skip
    assert len(lps) == 12 and all(len(e["top_logprobs"]) == 3 for e in lps)


def check_background(s: Server) -> None:
    body = resp(s, max_output_tokens=2, background=True)
    assert body["background"] is True and body["status"] in ("queued", "in_progress")
    resp_refused(s, "store", background=True, store=False)  # its result is polled


def unserved(name: str, value: Any) -> Callable[[Server], None]:
    def check(s: Server) -> None:
        assert resp_refused(s, name, **{name: value}) == f"{name} is not supported by this server"

    return check


def check_max_tool_calls(s: Server) -> None:
    """0 (no calls) is refused as any other count: never ignored as if unset."""
    unserved("max_tool_calls", 2)(s)
    unserved("max_tool_calls", 0)(s)


RESPONSES: dict[str, Callable[[Server], None]] = {
    "model": check_model,
    "input": check_input,
    "instructions": check_instructions,
    "tools": check_tools,
    "tool_choice": check_tool_choice,
    "parallel_tool_calls": check_parallel_tool_calls,
    "text": check_text,
    "reasoning": check_reasoning,
    "max_output_tokens": check_max_output_tokens,
    "temperature": check_temperature,
    "top_p": check_top_p,
    "stream": check_stream,
    "stream_options": check_stream_options,
    "store": check_store,
    "previous_response_id": check_previous_response_id,
    "metadata": echoed("metadata", {"team": "a"}, {"team": 1}),
    "user": echoed("user", "someone", 3),
    "safety_identifier": echoed("safety_identifier", "someone", 3),
    "prompt_cache_key": echoed("prompt_cache_key", "key-1", 3),
    "service_tier": check_service_tier,
    "include": check_include,
    "truncation": check_truncation,
    "top_logprobs": check_top_logprobs,
    "background": check_background,
    "conversation": unserved("conversation", "conv_1"),
    "prompt": unserved("prompt", {"id": "pmpt_1"}),
    "max_tool_calls": check_max_tool_calls,
}


# -- input items and their parts -----------------------------------------------------------


def items(*given: dict[str, Any]) -> dict[str, Any]:
    return {"input": list(given)}


def said(role: str, content: Any) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": content}


CALL = {"type": "function_call", "call_id": "c1", "name": "ping", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "pong"}
TURN = (said("user", ASK), CALL, OUTPUT)


def check_item_type(s: Server) -> None:
    assert input_tokens(s, **items(*TURN)) > input_tokens(s, **items(said("user", ASK)))
    resp_refused(s, "input[0].type", **items({"type": "item_reference", "id": "x"}))


def check_item_role(s: Server) -> None:
    system = input_tokens(s, **items(said("system", "Be brief."), said("user", ASK)))
    assert input_tokens(s, **items(said("developer", "Be brief."), said("user", ASK))) == system
    resp_refused(s, "input[0].role", **items(said("tool", ASK)))


def check_item_content(s: Server) -> None:
    parts = [{"type": "input_text", "text": ASK}]
    assert input_tokens(s, **items(said("user", parts))) == input_tokens(s)
    assert input_tokens(s, **items(said("user", ASK * 3))) > input_tokens(s)


def check_item_call_id(s: Server) -> None:
    resp_refused(s, "input[1]", **items(TURN[0], {**CALL, "call_id": None}, OUTPUT))
    resp_refused(s, "input[2]", **items(TURN[0], CALL, {**OUTPUT, "call_id": None}))


def check_item_name(s: Server) -> None:
    resp_refused(s, "input[1]", **items(TURN[0], {**CALL, "name": None}, OUTPUT))
    longer = {**CALL, "name": "ping_the_far_away_server_again"}
    assert input_tokens(s, **items(TURN[0], longer, OUTPUT)) > input_tokens(s, **items(*TURN))


def check_item_arguments(s: Server) -> None:
    given = {**CALL, "arguments": json.dumps({"host": "example.org", "count": 3})}
    assert input_tokens(s, **items(TURN[0], given, OUTPUT)) > input_tokens(s, **items(*TURN))


def check_item_output(s: Server) -> None:
    longer = {**OUTPUT, "output": "pong " * 10}
    assert input_tokens(s, **items(TURN[0], CALL, longer)) > input_tokens(s, **items(*TURN))


def reasoning_item(**fields: Any) -> dict[str, Any]:
    return {"type": "reasoning", "summary": [], **fields}


def check_item_summary(s: Server) -> None:
    """The summary is the next assistant turn's reasoning_content, which the chat template
    renders or not (this one does not, nor does vLLM add it): taken as text parts."""
    summary = [{"type": "summary_text", "text": "Think of apples."}]
    resp(s, max_output_tokens=1, **items(said("user", ASK), reasoning_item(summary=summary),
                                         said("assistant", "An apple a day.")))  # fmt: skip
    resp_refused(s, "input[0].summary", **items(reasoning_item(summary="x")))


def check_item_encrypted_content(s: Server) -> None:
    """trillm's own reasoning items carry null, which round-trips; another server's
    encrypted reasoning cannot be read, and is refused rather than dropped."""
    resp(s, max_output_tokens=1, **items(said("user", ASK), reasoning_item(encrypted_content=None)))
    message = resp_refused(
        s, "input[1].encrypted_content",
        **items(said("user", ASK), reasoning_item(encrypted_content="gAAAA")),
    )  # fmt: skip
    assert "send the reasoning as the item's content or summary" in message


def check_item_replayed(name: str, wrong: Any) -> Callable[[Server], None]:
    """An output item's `id` and `status` come back when a client replays the output as input
    (the SDK's `input += response.output`; vLLM's responses/test_replayed_input_items.py):
    they name the item and change nothing; taken as sent, refused when not a string."""

    def check(s: Server) -> None:
        first = resp(s, max_output_tokens=4)
        replayed = [said("user", ASK), *first["output"], said("user", "More.")]
        assert all(name in i for i in first["output"])
        plain = [said("user", ASK), said("assistant", out_text(first)), said("user", "More.")]
        assert input_tokens(s, input=replayed) == input_tokens(s, input=plain)
        resp_refused(s, f"input[0].{name}", **items({**said("user", ASK), name: wrong}))

    return check


def check_part_type(s: Server) -> None:
    image = {"type": "input_image", "image_url": "https://example.org/a.png"}
    resp_refused(s, "input[0].content[0].type", **items(said("user", [image])))


def check_part_text(s: Server) -> None:
    def part(text: str) -> dict[str, Any]:
        return items(said("user", [{"type": "input_text", "text": text}]))

    assert input_tokens(s, **part(ASK * 3)) > input_tokens(s, **part(ASK))


def check_part_refusal(s: Server) -> None:
    def refusing(text: str) -> dict[str, Any]:
        reply = said("assistant", [{"type": "refusal", "refusal": text}])
        return items(said("user", ASK), reply, said("user", "Why?"))

    assert input_tokens(s, **refusing("I cannot help. " * 5)) > input_tokens(s, **refusing("No."))


# -- tools, tool choice, text, reasoning, stream options -----------------------------------


def tools_tokens(s: Server, tool: dict[str, Any]) -> int:
    return input_tokens(s, tools=[tool])


def check_tool_type(s: Server) -> None:
    message = resp_refused(s, "tools[0].type", tools=[{"type": "file_search"}])
    assert "send function tools" in message


def check_tool_name(s: Server) -> None:
    resp_refused(s, "tools[0].name", tools=[{"type": "function"}])
    assert tools_tokens(s, {**TOOL, "name": "ping_the_far_away_server"}) > tools_tokens(s, TOOL)


def check_tool_description(s: Server) -> None:
    described = {**TOOL, "description": "Pings a server and says whether it answered."}
    assert tools_tokens(s, described) > tools_tokens(s, TOOL)


def check_tool_parameters(s: Server) -> None:
    params = {"type": "object", "properties": {"host": {"type": "string"}}}
    assert tools_tokens(s, {**TOOL, "parameters": params}) > tools_tokens(s, TOOL)


def check_tool_strict(s: Server) -> None:
    """strict (the Responses API's default: true) constrains a call's arguments to the
    parameters (test_request_fields.py's tools check serves it in chat); false is echoed."""
    body = resp(s, max_output_tokens=1, tools=[{**TOOL, "strict": False}])
    assert body["tools"][0]["strict"] is False
    resp_refused(s, "tools[0].strict", tools=[{**TOOL, "strict": "yes"}])


def check_choice_type(s: Server) -> None:
    resp_refused(s, "tool_choice", tools=[TOOL], tool_choice={"type": "web_search"})


def check_choice_name(s: Server) -> None:
    tools = [TOOL, {**TOOL, "name": "pong"}]
    named = {"type": "function", "name": "pong"}
    body = resp(s, max_output_tokens=48, temperature=0, tools=tools, tool_choice=named)
    assert calls(body)[:1] == ["pong"]
    resp_refused(s, "tool_choice", tools=[TOOL], tool_choice={"type": "function"})


def check_format_type(s: Server) -> None:
    body = resp(s, max_output_tokens=12, text={"format": {"type": "json_object"}})
    assert out_text(body).lstrip().startswith("{")  # an object, cut by the token limit
    resp_refused(s, "text.format.type", text={"format": {"type": "xml"}})


def check_format_name(s: Server) -> None:
    assert resp(s, max_output_tokens=1, text={"format": FORMAT})["text"]["format"]["name"] == "pick"
    resp_refused(s, "text.format.name", text={"format": {**FORMAT, "name": 3}})
    resp_refused(s, "text.format.name", text={"format": {**FORMAT, "name": "a b"}})


def check_format_schema(s: Server) -> None:
    schema = {"enum": ["gamma"]}
    body = resp(s, max_output_tokens=12, text={"format": {**FORMAT, "schema": schema}})
    assert json.loads(out_text(body)) == "gamma"


def check_format_strict(s: Server) -> None:
    """Non-strict asks for the schema at best; trillm's grammar holds it either way."""
    body = resp(s, max_output_tokens=12, text={"format": {**FORMAT, "strict": False}})
    assert json.loads(out_text(body)) in SCHEMA["enum"]
    assert body["text"]["format"]["strict"] is False


def check_format_description(s: Server) -> None:
    """What the format is for, echoed (vLLM, too, gives it no other use)."""
    fmt = {**FORMAT, "description": "a Greek letter"}
    body = resp(s, max_output_tokens=1, text={"format": fmt})
    assert body["text"]["format"]["description"] == "a Greek letter"


def check_text_format(s: Server) -> None:
    check_format_schema(s)
    assert resp(s, max_output_tokens=1)["text"] == {"format": {"type": "text"}}


def check_verbosity(s: Server) -> None:
    assert resp(s, max_output_tokens=1, text={"verbosity": "medium"})["text"]["verbosity"]
    resp_refused(s, "text.verbosity", text={"verbosity": "low"})


def check_effort(s: Server) -> None:
    """vLLM's chat_completion/test_reasoning_effort.py: the template's variable; a value
    outside the API's levels is refused."""
    check_reasoning(s)


def summary(name: str) -> Callable[[Server], None]:
    def check(s: Server) -> None:
        assert resp(s, max_output_tokens=1, reasoning={name: "auto"})["reasoning"][name] == "auto"
        message = resp_refused(s, f"reasoning.{name}", reasoning={name: "detailed"})
        assert "returns the reasoning text itself" in message

    return check


def check_include_obfuscation(s: Server) -> None:
    options = {"include_obfuscation": True}
    resp_refused(s, "stream_options.include_obfuscation", stream=True, stream_options=options)
    events = sse(s, max_output_tokens=2, stream_options={"include_obfuscation": False})
    assert all("obfuscation" not in e for e in events)


# -- the pooling routes --------------------------------------------------------------------


def embed(s: Server, **fields: Any) -> dict[str, Any]:
    return ok(s, "/v1/embeddings", {"input": TEXTS[0], **fields})


def vector(body: dict[str, Any], i: int = 0) -> np.ndarray:
    return np.asarray(body["data"][i]["embedding"], np.float32)


def pooled_model(path: str, body: dict[str, Any]) -> Callable[[Server], None]:
    def check(s: Server) -> None:
        assert ok(s, path, {**body, "model": "tiny"})["model"] == "tiny"
        assert post(s, path, {**body, "model": "not-served"}).status_code == 404

    return check


def salted(path: str, body: dict[str, Any]) -> Callable[[Server], None]:
    """A salt shares cache blocks only within itself: it changes no result, and an empty
    one is refused (generation's rule)."""

    def check(s: Server) -> None:
        ok(s, path, {**body, "cache_salt": "a"})
        refused(s, path, "cache_salt", {**body, "cache_salt": ""})

    return check


def truncated(path: str, body: dict[str, Any]) -> Callable[[Server], None]:
    """vLLM's embedding_tests truncate_prompt_tokens cases: the last this many tokens."""

    def check(s: Server) -> None:
        usage = ok(s, path, {**body, "truncate_prompt_tokens": 3})["usage"]
        assert usage["total_tokens"] < ok(s, path, body)["usage"]["total_tokens"]
        refused(s, path, "truncate_prompt_tokens", {**body, "truncate_prompt_tokens": 0})

    return check


def check_embed_input(s: Server) -> None:
    body = ok(s, "/v1/embeddings", {"input": TEXTS})
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert not np.allclose(vector(body, 0), vector(body, 1))
    refused(s, "/v1/embeddings", "input", {"input": []})


def check_encoding_format(s: Server) -> None:
    """vLLM's test_embedding.py base64 case: the same floats, little-endian float32."""
    raw = embed(s, encoding_format="base64")["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(raw), "<f4")
    assert np.allclose(decoded, vector(embed(s)), atol=1e-6)
    refused(s, "/v1/embeddings", "encoding_format", {"input": "x", "encoding_format": "hex"})


def check_dimensions(s: Server) -> None:
    """vLLM's test_embedding_dimensions.py: the first this many, normalised again."""
    cut = vector(embed(s, dimensions=16))
    assert len(cut) == 16 and abs(np.linalg.norm(cut) - 1) < 1e-5
    refused(s, "/v1/embeddings", "dimensions", {"input": "x", "dimensions": 0})


def check_embed_user(s: Server) -> None:
    """OpenAI's end-user id: an annotation, taken as a string and refused otherwise."""
    assert np.allclose(vector(embed(s, user="someone")), vector(embed(s)), atol=1e-6)
    refused(s, "/v1/embeddings", "user", {"input": "x", "user": 3})


def check_normalize(s: Server) -> None:
    assert abs(np.linalg.norm(vector(embed(s, normalize=True))) - 1) < 1e-5
    assert abs(np.linalg.norm(vector(embed(s, normalize=False))) - 1) > 1e-3


def check_embed_special_tokens(s: Server, tokenizer: Any) -> None:
    """As vLLM's test_tokenization.py counts them: the tokenizer's, with or without."""
    for special in (True, False):
        body = embed(s, add_special_tokens=special)
        expected = tokenizer(TEXTS[0], add_special_tokens=special)["input_ids"]
        assert body["usage"]["prompt_tokens"] == len(expected)


SCORE = {"text_1": TEXTS[0], "text_2": TEXTS}
RERANK = {"query": TEXTS[0], "documents": [TEXTS[1], TEXTS[0]]}


def scores(s: Server, **fields: Any) -> list[float]:
    return [d["score"] for d in ok(s, "/score", {**SCORE, **fields})["data"]]


def check_text_1(s: Server) -> None:
    same, other = scores(s)
    assert abs(same - 1) < 1e-5 and other < same
    assert scores(s, text_1=TEXTS[1])[1] > other
    refused(s, "/score", "text_1", {**SCORE, "text_1": ""})


def check_text_2(s: Server) -> None:
    assert len(scores(s, text_2=TEXTS[0])) == 1
    refused(s, "/score", "text_2", {**SCORE, "text_1": TEXTS * 2, "text_2": TEXTS[:1] * 3})


def rerank(s: Server, **fields: Any) -> list[dict[str, Any]]:
    return list(ok(s, "/rerank", {**RERANK, **fields})["results"])


def check_query(s: Server) -> None:
    assert [r["index"] for r in rerank(s)] == [1, 0]
    assert [r["index"] for r in rerank(s, query=TEXTS[1])] == [0, 1]
    refused(s, "/rerank", "query", {**RERANK, "query": ""})


def check_documents(s: Server) -> None:
    assert [r["document"]["text"] for r in rerank(s)] == [TEXTS[0], TEXTS[1]]
    refused(s, "/rerank", "documents", {**RERANK, "documents": []})


def check_top_n(s: Server) -> None:
    assert [r["index"] for r in rerank(s, top_n=1)] == [1]
    refused(s, "/rerank", "top_n", {**RERANK, "top_n": 0})


def check_return_documents(s: Server) -> None:
    assert all("document" not in r for r in rerank(s, return_documents=False))
    assert all("document" in r for r in rerank(s))


# -- the tokenizer routes ------------------------------------------------------------------

CHAT = [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Hello."}]


def tokenize(s: Server, **fields: Any) -> list[int]:
    return list(ok(s, "/tokenize", fields)["tokens"])


def check_tokenize_model(s: Server) -> None:
    """vLLM's serving_tokenization checks the model, as every route does."""
    assert tokenize(s, model="tiny", prompt="Hi")
    assert post(s, "/tokenize", {"model": "not-served", "prompt": "Hi"}).status_code == 404


def check_tokenize_prompt(s: Server, tokenizer: Any) -> None:
    """vLLM's test_tokenization.py::test_tokenize_completions."""
    prompt = "vllm1 This is a test prompt."
    assert tokenize(s, prompt=prompt) == tokenizer(prompt)["input_ids"]
    refused(s, "/tokenize", "prompt", {})


def template(tokenizer: Any, *, add_generation_prompt: bool = True) -> str:
    text: str = tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return text


def check_tokenize_messages(s: Server, tokenizer: Any) -> None:
    """vLLM's test_tokenization.py::test_tokenize_chat."""
    expected = tokenizer(template(tokenizer), add_special_tokens=False)["input_ids"]
    assert tokenize(s, messages=CHAT) == expected
    refused(s, "/tokenize", "prompt", {"prompt": "Hi", "messages": CHAT})


def check_tokenize_special_tokens(s: Server, tokenizer: Any) -> None:
    """vLLM's test_tokenize_completions and test_tokenize_chat: a prompt's and a rendered
    template's, with and without the tokenizer's special tokens."""
    for special in (True, False):
        prompt = tokenizer("Hi", add_special_tokens=special)["input_ids"]
        assert tokenize(s, prompt="Hi", add_special_tokens=special) == prompt
        chat = tokenizer(template(tokenizer), add_special_tokens=special)["input_ids"]
        assert tokenize(s, messages=CHAT, add_special_tokens=special) == chat


def check_add_generation_prompt(s: Server, tokenizer: Any) -> None:
    closed = tokenizer(template(tokenizer, add_generation_prompt=False), add_special_tokens=False)
    assert tokenize(s, messages=CHAT, add_generation_prompt=False) == closed["input_ids"]
    assert len(tokenize(s, messages=CHAT)) > len(closed["input_ids"])


def check_tokenize_template_kwargs(s: Server) -> None:
    assert tokenize(s, messages=CHAT, chat_template_kwargs={"some_variable": 1})
    body = {"messages": CHAT, "chat_template_kwargs": {"tools": []}}
    refused(s, "/tokenize", "chat_template_kwargs.tools", body)


def check_return_token_strs(s: Server, tokenizer: Any) -> None:
    """vLLM's test_tokenization.py::test_tokenize_with_return_token_strs."""
    body = ok(s, "/tokenize", {"prompt": "Hi there", "return_token_strs": True})
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert ok(s, "/tokenize", {"prompt": "Hi there"})["token_strs"] is None


def check_detokenize_model(s: Server) -> None:
    assert ok(s, "/detokenize", {"model": "tiny", "tokens": [3289]})["prompt"]
    assert post(s, "/detokenize", {"model": "not-served", "tokens": [1]}).status_code == 404


def check_detokenize_tokens(s: Server, tokenizer: Any) -> None:
    """vLLM's test_tokenization.py::test_detokenize."""
    prompt = "This is a test prompt. vllm1"
    tokens = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ok(s, "/detokenize", {"tokens": tokens}) == {"prompt": prompt}
    refused(s, "/detokenize", "tokens", {"tokens": [10**9]})


Check = Callable[[Server, Any], None]


def plain(check: Callable[[Server], None]) -> Check:
    return lambda s, _tokenizer: check(s)


EMBED_BODY = {"input": TEXTS[0]}
POOLING: dict[tuple[type[Any], str], Callable[[Server], None]] = {
    (P.EmbeddingRequest, "input"): check_embed_input,
    (P.EmbeddingRequest, "model"): pooled_model("/v1/embeddings", EMBED_BODY),
    (P.EmbeddingRequest, "encoding_format"): check_encoding_format,
    (P.EmbeddingRequest, "dimensions"): check_dimensions,
    (P.EmbeddingRequest, "user"): check_embed_user,
    (P.EmbeddingRequest, "truncate_prompt_tokens"): truncated("/v1/embeddings", EMBED_BODY),
    (P.EmbeddingRequest, "normalize"): check_normalize,
    (P.EmbeddingRequest, "cache_salt"): salted("/v1/embeddings", EMBED_BODY),
    (P.ScoreRequest, "text_1"): check_text_1,
    (P.ScoreRequest, "text_2"): check_text_2,
    (P.ScoreRequest, "model"): pooled_model("/score", SCORE),
    (P.ScoreRequest, "truncate_prompt_tokens"): truncated("/score", SCORE),
    (P.ScoreRequest, "cache_salt"): salted("/score", SCORE),
    (P.RerankRequest, "query"): check_query,
    (P.RerankRequest, "documents"): check_documents,
    (P.RerankRequest, "model"): pooled_model("/rerank", RERANK),
    (P.RerankRequest, "top_n"): check_top_n,
    (P.RerankRequest, "return_documents"): check_return_documents,
    (P.RerankRequest, "truncate_prompt_tokens"): truncated("/rerank", RERANK),
    (P.RerankRequest, "cache_salt"): salted("/rerank", RERANK),
}
NESTED: dict[tuple[type[Any], str], Callable[[Server], None]] = {
    (A.InputItem, "type"): check_item_type,
    (A.InputItem, "role"): check_item_role,
    (A.InputItem, "content"): check_item_content,
    (A.InputItem, "call_id"): check_item_call_id,
    (A.InputItem, "name"): check_item_name,
    (A.InputItem, "arguments"): check_item_arguments,
    (A.InputItem, "output"): check_item_output,
    (A.InputItem, "summary"): check_item_summary,
    (A.InputItem, "encrypted_content"): check_item_encrypted_content,
    (A.InputItem, "id"): check_item_replayed("id", 3),
    (A.InputItem, "status"): check_item_replayed("status", 3),
    (A.InputPart, "type"): check_part_type,
    (A.InputPart, "text"): check_part_text,
    (A.InputPart, "refusal"): check_part_refusal,
    (A.FunctionTool, "type"): check_tool_type,
    (A.FunctionTool, "name"): check_tool_name,
    (A.FunctionTool, "description"): check_tool_description,
    (A.FunctionTool, "parameters"): check_tool_parameters,
    (A.FunctionTool, "strict"): check_tool_strict,
    (A.ToolChoiceObject, "type"): check_choice_type,
    (A.ToolChoiceObject, "name"): check_choice_name,
    (A.TextFormat, "type"): check_format_type,
    (A.TextFormat, "name"): check_format_name,
    (A.TextFormat, "schema"): check_format_schema,
    (A.TextFormat, "strict"): check_format_strict,
    (A.TextFormat, "description"): check_format_description,
    (A.TextConfig, "format"): check_text_format,
    (A.TextConfig, "verbosity"): check_verbosity,
    (A.ReasoningConfig, "effort"): check_effort,
    (A.ReasoningConfig, "summary"): summary("summary"),
    (A.ReasoningConfig, "generate_summary"): summary("generate_summary"),
    (A.StreamOptions, "include_obfuscation"): check_include_obfuscation,
}
CHECKS: dict[tuple[type[Any], str], Check] = {
    **{(A.ResponsesRequest, f): plain(c) for f, c in RESPONSES.items()},
    **{k: plain(c) for k, c in NESTED.items()},
    **{k: plain(c) for k, c in POOLING.items()},
    (P.EmbeddingRequest, "add_special_tokens"): check_embed_special_tokens,
    (R.TokenizeRequest, "model"): plain(check_tokenize_model),
    (R.TokenizeRequest, "prompt"): check_tokenize_prompt,
    (R.TokenizeRequest, "messages"): check_tokenize_messages,
    (R.TokenizeRequest, "add_special_tokens"): check_tokenize_special_tokens,
    (R.TokenizeRequest, "add_generation_prompt"): check_add_generation_prompt,
    (R.TokenizeRequest, "chat_template_kwargs"): plain(check_tokenize_template_kwargs),
    (R.TokenizeRequest, "return_token_strs"): check_return_token_strs,
    (R.DetokenizeRequest, "model"): plain(check_detokenize_model),
    (R.DetokenizeRequest, "tokens"): check_detokenize_tokens,
}
STRUCTS = (
    A.ResponsesRequest, A.InputItem, A.InputPart, A.FunctionTool, A.ToolChoiceObject,
    A.TextFormat, A.TextConfig, A.ReasoningConfig, A.StreamOptions,
    P.EmbeddingRequest, P.ScoreRequest, P.RerankRequest, R.TokenizeRequest, R.DetokenizeRequest,
)  # fmt: skip


def test_every_request_field_has_a_check() -> None:
    fields = {(kind, f.name) for kind in STRUCTS for f in msgspec.structs.fields(kind)}
    assert sorted((k.__name__, f) for k, f in fields - CHECKS.keys()) == []
    assert sorted((k.__name__, f) for k, f in CHECKS.keys() - fields) == []


@pytest.mark.parametrize(
    ("struct", "field"), sorted(CHECKS, key=lambda k: (k[0].__module__, k[0].__name__, k[1])),
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)  # fmt: skip
def test_the_field_works_or_is_a_400_naming_it(
    request: pytest.FixtureRequest, tokenizer: Any, struct: type[Any], field: str
) -> None:
    reasons = struct is A.ReasoningConfig or (struct, field) == (A.ResponsesRequest, "reasoning")
    server = request.getfixturevalue("reasoner" if reasons else "live")
    CHECKS[(struct, field)](server, tokenizer)


def test_reasoning_needs_a_reasoning_parser(live: Server) -> None:
    message = resp_refused(live, "reasoning", reasoning={"effort": "low"})
    assert message == "reasoning needs a reasoning model: this server runs no --reasoning-parser"
