"""Every route's real response bodies, every SSE chunk and every Responses stream event of a
live `trillm serve`, validated against OpenAI's published component schemas.

The schemas are a copy of the spec's (openai_schema/components.json; README.md names the
source and commit). The tiny random model's text is noise: what is checked is the shape.
"""

from __future__ import annotations

import array
import base64
import copy
import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import referencing

from .conftest import Server, start_server

KEY = "sk-schema"
COMPONENTS = Path(__file__).with_name("openai_schema") / "components.json"
SPEC_URI = "urn:openai-openapi"
ZONE = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
CHAT_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
PROMPT = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}


def nullable_as_union(node: Any) -> Any:
    """OpenAPI 3.0's `nullable: true` (a few are left in the 3.1 spec) as JSON Schema's null."""
    if isinstance(node, dict):
        node = {k: nullable_as_union(v) for k, v in node.items()}
        if node.pop("nullable", False) is True:
            if isinstance(node.get("type"), str):
                node["type"] = [node["type"], "null"]
                if "enum" in node:
                    node["enum"] = [*node["enum"], None]
            else:
                node = {"anyOf": [node, {"type": "null"}]}
        return node
    if isinstance(node, list):
        return [nullable_as_union(v) for v in node]
    return node


def completion_chunk(whole: dict[str, Any]) -> dict[str, Any]:
    """A streamed legacy completion's schema: the spec has none (it names the whole one), and
    OpenAI's own chunks carry a null `finish_reason` until the last and, with include_usage,
    a null `usage`; everything else is the whole completion's."""
    chunk = copy.deepcopy(whole)
    choice = chunk["properties"]["choices"]["items"]["properties"]
    choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
    chunk["properties"]["usage"] = {"anyOf": [chunk["properties"]["usage"], {"type": "null"}]}
    return dict(chunk)


@cache
def validator(name: str) -> jsonschema.Draft202012Validator:
    """A validator of the component schema `name`, its `$ref`s resolved in the copy."""
    named = nullable_as_union(schemas())
    named["CompletionChunk"] = completion_chunk(named["CreateCompletionResponse"])
    document = {"components": {"schemas": named}}
    resource = referencing.Resource.from_contents(
        document, default_specification=referencing.jsonschema.DRAFT202012
    )
    registry: referencing.Registry[Any] = referencing.Registry().with_resource(SPEC_URI, resource)
    schema = {"$ref": f"{SPEC_URI}#/components/schemas/{name}"}
    return jsonschema.Draft202012Validator(schema, registry=registry)


@cache
def schemas() -> dict[str, Any]:
    return dict(json.loads(COMPONENTS.read_text())["schemas"])


def event_schema(kind: str) -> str:
    """The name of the `ResponseStreamEvent` branch for events of type `kind`."""
    for branch in schemas()["ResponseStreamEvent"]["anyOf"]:
        name = branch["$ref"].rpartition("/")[2]
        if kind in schemas()[name]["properties"]["type"].get("enum", ()):
            return str(name)
    raise AssertionError(f"OpenAI's spec has no stream event of type {kind!r}")


def check(name: str, body: Any) -> None:
    """`body` is a valid `name`; else fails naming every violation and where it is."""
    errors = sorted(validator(name).iter_errors(body), key=lambda e: list(e.absolute_path))
    problems = [f"{'/'.join(map(str, e.absolute_path)) or '.'}: {e.message}" for e in errors]
    for e in errors:  # a oneOf/anyOf names its branches' reasons only in its context
        problems += [
            f"  {'/'.join(map(str, c.absolute_path))}: {c.message}" for c in e.context or ()
        ][:12]
    assert not problems, f"not a valid {name}:\n" + "\n".join(problems)


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[Server]:
    server = start_server(tiny_model, "--api-key", KEY)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as client:
        yield client


def post(client: httpx.Client, path: str, body: dict[str, Any]) -> Any:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse(client: httpx.Client, path: str, body: dict[str, Any]) -> list[tuple[str | None, Any]]:
    """The (event name, data) of every server-sent event, up to chat's `[DONE]`."""
    events: list[tuple[str | None, Any]] = []
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        name: str | None = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = line[len("data: ") :]
                if data == "[DONE]":
                    return events
                events.append((name, json.loads(data)))
                name = None
    return events


# -- chat completions ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"n": 2, "logprobs": True, "top_logprobs": 2},
        {"tools": [CHAT_TOOL], "tool_choice": "required", "max_tokens": 60},
        {"response_format": {"type": "json_object"}, "seed": 1},
    ],
    ids=["plain", "logprobs", "tool-call", "json"],
)
def test_chat_completions(client: httpx.Client, extra: dict[str, Any]) -> None:
    body = post(client, "/v1/chat/completions", {**CHAT, **extra})
    check("CreateChatCompletionResponse", body)
    message = body["choices"][0]["message"]
    assert message["refusal"] is None
    assert "prompt_tokens_details" not in body["usage"]
    if "logprobs" in extra:
        assert body["choices"][0]["logprobs"]["refusal"] is None
    if "tools" in extra:
        assert message["tool_calls"][0]["function"]["name"] == "get_time"


@pytest.mark.parametrize(
    "extra",
    [
        {"stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 1},
        {"tools": [CHAT_TOOL], "tool_choice": "required", "n": 2, "max_tokens": 60},
    ],
    ids=["usage-logprobs", "tool-call"],
)
def test_chat_completion_chunks(client: httpx.Client, extra: dict[str, Any]) -> None:
    chunks = [data for _, data in sse(client, "/v1/chat/completions", {**CHAT, **extra})]
    assert len(chunks) >= 3
    for chunk in chunks:
        check("CreateChatCompletionStreamResponse", chunk)
    if "stream_options" in extra:
        assert chunks[-1]["choices"] == [] and "prompt_tokens_details" not in chunks[-1]["usage"]
        logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
        refusals = [lp["refusal"] for lp in logprobs if lp is not None]
        assert refusals and set(refusals) == {None}


# -- completions -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra", [{}, {"logprobs": 2, "echo": True, "n": 2}], ids=["plain", "logprobs-echo"]
)
def test_completions(client: httpx.Client, extra: dict[str, Any]) -> None:
    body = post(client, "/v1/completions", {**PROMPT, **extra})
    check("CreateCompletionResponse", body)
    assert "prompt_tokens_details" not in body["usage"]


def test_completion_chunks(client: httpx.Client) -> None:
    body = {**PROMPT, "logprobs": 1, "stream_options": {"include_usage": True}}
    chunks = [data for _, data in sse(client, "/v1/completions", body)]
    assert len(chunks) >= 3 and chunks[-1]["usage"]["completion_tokens"] == 4
    for chunk in chunks[:-1]:
        check("CompletionChunk", chunk)
    check("CreateCompletionResponse", chunks[-1])  # the usage chunk: a whole completion


# -- embeddings, models, errors -------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_embeddings(client: httpx.Client, encoding: str) -> None:
    body = {"model": "tiny", "input": ["one", "two"], "encoding_format": encoding}
    response = post(client, "/v1/embeddings", body)
    if encoding == "base64":  # the spec has only the float list; OpenAI sends a string here
        for item in response["data"]:
            raw = base64.b64decode(item["embedding"], validate=True)
            item["embedding"] = array.array("f", raw).tolist()
    check("CreateEmbeddingResponse", response)


def test_models_list_and_retrieve(server: Server, client: httpx.Client) -> None:
    models = client.get("/v1/models").json()
    check("ListModelsResponse", models)
    (card,) = models["data"]
    assert card["root"] == "tiny"  # started from a path here: the served name stands for it
    one = client.get("/v1/models/tiny")
    assert one.status_code == 200
    check("Model", one.json())
    assert one.json() == card
    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
    assert sdk.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.models.retrieve("org/nothing")
    assert caught.value.code == "model_not_found"


ERRORS = [
    ("GET", "/v1/models/nothing", None, 404),
    ("GET", "/v1/nothing", None, 404),
    ("GET", "/v1/chat/completions", None, 405),
    ("POST", "/v1/chat/completions", {"model": "tiny"}, 400),
    ("POST", "/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404),
    ("POST", "/v1/completions", {**PROMPT, "max_tokens": -1}, 400),
    ("POST", "/v1/embeddings", {"model": "tiny", "input": []}, 400),
    (
        "POST",
        "/v1/responses",
        {"model": "tiny", "input": "x", "background": True, "store": False},
        400,
    ),
    ("GET", "/v1/responses/resp_nothing", None, 404),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), ERRORS)
def test_errors(
    client: httpx.Client, method: str, path: str, body: dict[str, Any] | None, status: int
) -> None:
    r = client.request(method, path, json=body)
    assert r.status_code == status, r.text
    check("ErrorResponse", r.json())


def test_a_missing_key_is_an_error_body(server: Server) -> None:
    r = httpx.get(f"{server.base_url}/v1/models", timeout=30)
    assert r.status_code == 401
    check("ErrorResponse", r.json())


# -- Responses -------------------------------------------------------------------------------

RESPONSE_TOOL = {"type": "function", "name": "get_time", "parameters": ZONE}
JSON_FORMAT = {"type": "json_schema", "name": "zone", "schema": ZONE, "strict": True}
RESPONSES = [
    {"instructions": "Be brief."},
    {"tools": [RESPONSE_TOOL], "tool_choice": "required", "max_output_tokens": 60},
    {
        "tools": [RESPONSE_TOOL],
        "tool_choice": {"type": "function", "name": "get_time"},
        "max_output_tokens": 60,
    },
    {"text": {"format": JSON_FORMAT}, "max_output_tokens": 40},
    {"text": {"format": {"type": "json_object"}, "verbosity": "medium"}},
    {"metadata": {"k": "v"}, "temperature": 0.5, "top_p": 0.9, "user": "u-1"},
]
RESPONSE_IDS = ["plain", "tool-required", "tool-named", "json-schema", "json-object", "settings"]


@pytest.mark.parametrize("extra", RESPONSES, ids=RESPONSE_IDS)
def test_responses(client: httpx.Client, extra: dict[str, Any]) -> None:
    body = {"model": "tiny", "input": "Hello", "max_output_tokens": 6, **extra}
    response = post(client, "/v1/responses", body)
    check("Response", response)
    if "text" in extra:
        assert response["text"] == extra["text"]  # as sent: no field it did not set
    stored = client.get(f"/v1/responses/{response['id']}")
    assert stored.status_code == 200
    check("Response", stored.json())


@pytest.mark.parametrize("extra", RESPONSES, ids=RESPONSE_IDS)
def test_responses_stream_events(client: httpx.Client, extra: dict[str, Any]) -> None:
    body = {"model": "tiny", "input": "Hello", "max_output_tokens": 6, **extra}
    events = sse(client, "/v1/responses", body)
    names = [name for name, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] in ("response.completed", "response.incomplete")
    for name, event in events:
        assert event["type"] == name
        check(event_schema(name), event)  # its own branch: a failure says what is wrong
        check("ResponseStreamEvent", event)
    check("Response", events[-1][1]["response"])
