"""Agent libraries against `trillm serve` of the default model (SmolLM2-135M-Instruct).

The OpenAI Agents SDK (its default model class, `OpenAIResponsesModel`: `POST /v1/responses`),
pydantic-ai (its OpenAI chat model, structured output) and LangChain's `ChatOpenAI` (tools and
structured output), each with its own client, as a user would wire them. A tiny model's poor
choice (the wrong zone, a call where text would do) passes; what fails is a shape the library
rejects. Every request the libraries send is recorded, so a check also says which route and
which mechanism (a forced tool, a json_schema format) the library chose.

Greedy (temperature 0) and forced where a check needs a call or an object: `tool_choice`
"required" or a named tool, or a json_schema format, all held by the server's grammar, so
the outcome does not hang on the model. Forced calls go with `parallel_tool_calls` false:
left free, this model repeats the call until `max_tokens`, and the cut-off last call turns
the whole response incomplete.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import agents
import openai
import pytest
from agents import (
    Agent,
    MessageOutputItem,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    ToolCallItem,
    ToolCallOutputItem,
    function_tool,
)
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import NativeOutput
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from trillm.default_model import default_model_dir

from .conftest import Server, start_server

# Slow: the 135M model on two slow cores, with its prompts of tool schemas (~200 tokens).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KEY = "sk-agent-clients"
MODEL = "tiny"  # the served name (conftest's serve_command)
MAX_TOKENS = 60  # a call of get_time is ~30 tokens, a City ~15


class City(BaseModel):
    name: str
    country: str


@dataclass
class Requests:
    """What a library sent: each request's path and JSON body, in order."""

    sent: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def record(self, request: Any) -> None:  # an httpx2.Request (the openai SDK's httpx)
        self.sent.append((request.url.path, json.loads(request.content or b"{}")))

    async def record_async(self, request: Any) -> None:
        self.record(request)

    def paths(self) -> list[str]:
        return [path for path, _ in self.sent]


@pytest.fixture(scope="module", autouse=True)
def offline() -> Iterator[None]:
    """No library phones home: tracing off, a dummy key where one is read by default."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
        patch.setenv("LANGSMITH_TRACING", "false")
        patch.setenv("LANGCHAIN_TRACING_V2", "false")
        patch.setenv("OPENAI_API_KEY", "sk-dummy-never-sent")
        agents.set_tracing_disabled(True)
        yield


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # The default model's KV cache at float32 is 45 KiB a token: 256 MiB holds ~5,800.
    kv_cache = ("--kv-cache-memory-bytes", str(1 << 28), "--max-model-len", "2048")
    server = start_server(default_model_dir(), "--api-key", KEY, *kv_cache)
    try:
        yield server
    finally:
        server.stop()


def async_client(server: Server, requests: Requests) -> openai.AsyncOpenAI:
    http = openai.DefaultAsyncHttpxClient(
        timeout=240, event_hooks={"request": [requests.record_async]}
    )
    return openai.AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, http_client=http
    )


# -- OpenAI Agents SDK ------------------------------------------------------------------------


@dataclass
class Clock:
    """A `get_time` tool that records the zones it was called with."""

    zones: list[str] = field(default_factory=list)

    def tool(self) -> agents.FunctionTool:
        @function_tool
        def get_time(zone: str) -> str:
            """The current time in a time zone."""
            self.zones.append(zone)
            return f"12:00 in {zone}"

        return get_time


def clock_agent(
    clock: Clock,
    model: str | OpenAIResponsesModel,
    max_tokens: int = MAX_TOKENS,
    behavior: Literal["stop_on_first_tool", "run_llm_again"] = "stop_on_first_tool",
) -> Agent[None]:
    # stop_on_first_tool: the run ends with the tool's result as its final output, so a
    # forced call is one turn (and tool_choice "required" never loops to max_turns).
    # run_llm_again: the result goes back to the model, with tool_choice reset to "auto"
    # (the SDK's reset_tool_choice).
    return Agent(
        name="clock",
        instructions="Answer with the get_time tool.",
        tools=[clock.tool()],
        model=model,
        model_settings=ModelSettings(
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=max_tokens,
        ),
        tool_use_behavior=behavior,
    )


def agents_model(server: Server, requests: Requests, how: str) -> str | OpenAIResponsesModel:
    """The agent's model: the SDK's default (a name, resolved by its default provider with
    the default client) or `OpenAIResponsesModel` built by hand; both speak Responses."""
    client = async_client(server, requests)
    if how == "explicit":
        return OpenAIResponsesModel(model=MODEL, openai_client=client)
    # Process-wide, like a user's setup: later default-model agents in this process use it.
    agents.set_default_openai_client(client, use_for_tracing=False)
    agents.set_default_openai_api("responses")
    assert type(agents.MultiProvider().get_model(MODEL)) is OpenAIResponsesModel
    return MODEL


@pytest.mark.parametrize("how", ["default", "explicit"])
def test_agents_sdk_runs_a_tool_over_the_responses_api(server: Server, how: str) -> None:
    requests, clock = Requests(), Clock()
    agent = clock_agent(clock, agents_model(server, requests, how))

    result = asyncio.run(Runner.run(agent, "What time is it in UTC?", max_turns=3))

    assert requests.paths() == ["/v1/responses"]
    (body,) = [body for _, body in requests.sent]
    assert (body["tool_choice"], body["parallel_tool_calls"]) == ("required", False)
    assert len(clock.zones) == 1 and isinstance(clock.zones[0], str)
    assert result.final_output == f"12:00 in {clock.zones[0]}"
    kinds = [type(item) for item in result.new_items]
    assert kinds == [ToolCallItem, ToolCallOutputItem]
    call = result.new_items[0].raw_item
    assert getattr(call, "name", None) == "get_time"
    assert json.loads(getattr(call, "arguments", "")) == {"zone": clock.zones[0]}


def test_agents_sdk_sends_the_tool_result_back_for_an_answer(server: Server) -> None:
    """Turn 2's input is the SDK's replay of turn 1 (the user's message, the
    `function_call` item, its `function_call_output`); the server takes it and answers."""
    requests, clock = Requests(), Clock()
    model = agents_model(server, requests, "explicit")
    agent = clock_agent(clock, model, behavior="run_llm_again")

    try:
        result = asyncio.run(Runner.run(agent, "What time is it in UTC?", max_turns=3))
    except MaxTurnsExceeded:  # the model's choice: it called again on each "auto" turn
        assert len(clock.zones) == 3
    else:
        assert isinstance(result.final_output, str) and result.final_output.strip()
        assert type(result.new_items[-1]) is MessageOutputItem
        assert [type(i) for i in result.new_items[:2]] == [ToolCallItem, ToolCallOutputItem]
    first, second, *_ = [body for _, body in requests.sent]
    assert (first["tool_choice"], second.get("tool_choice", "auto")) == ("required", "auto")
    replayed = [item.get("type", "message") for item in second["input"]]
    assert replayed == ["message", "function_call", "function_call_output"]
    assert second["input"][2]["output"] == f"12:00 in {clock.zones[0]}"


def test_agents_sdk_streams_a_tool_run(server: Server) -> None:
    requests, clock = Requests(), Clock()
    agent = clock_agent(clock, agents_model(server, requests, "explicit"))

    async def run() -> tuple[list[str], list[str], Any]:
        streamed = Runner.run_streamed(agent, "What time is it in CET?", max_turns=3)
        raw: list[str] = []
        items: list[str] = []
        async for event in streamed.stream_events():
            if event.type == "raw_response_event":
                raw.append(event.data.type)
            elif event.type == "run_item_stream_event":
                items.append(event.name)
        return raw, items, streamed.final_output

    raw, items, final_output = asyncio.run(run())

    assert requests.paths() == ["/v1/responses"] and requests.sent[0][1]["stream"] is True
    assert len(clock.zones) == 1
    assert final_output == f"12:00 in {clock.zones[0]}"
    assert items == ["tool_called", "tool_output"]
    assert raw[:2] == ["response.created", "response.in_progress"]
    assert raw[-1] == "response.completed"
    assert "response.function_call_arguments.done" in raw


def test_agents_sdk_refuses_a_response_cut_off_by_max_tokens(server: Server) -> None:
    """A forced call cut short is `incomplete`, which the SDK raises on (it does not guess)."""
    requests, clock = Requests(), Clock()
    agent = clock_agent(clock, agents_model(server, requests, "explicit"), max_tokens=4)

    with pytest.raises(ModelBehaviorError, match="max_output_tokens"):
        asyncio.run(Runner.run(agent, "What time is it in UTC?", max_turns=3))
    assert clock.zones == []


# -- pydantic-ai ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["tool", "native"])
def test_pydantic_ai_returns_a_structured_output(server: Server, mode: str) -> None:
    """Both modes are deterministic here: the default, "tool" (an output tool forced by
    tool_choice "required"), and "native" (`NativeOutput`: a json_schema response_format);
    the server's grammar holds either to the schema, so validation never needs a retry."""
    requests = Requests()
    provider = OpenAIProvider(openai_client=async_client(server, requests))
    model = OpenAIChatModel(MODEL, provider=provider)
    output_type: Any = NativeOutput(City) if mode == "native" else City
    settings: Any = {"temperature": 0, "max_tokens": MAX_TOKENS, "parallel_tool_calls": False}
    agent = PydanticAgent(model, output_type=output_type, model_settings=settings)

    result = agent.run_sync("Which city is the capital of France, and in which country?")

    assert isinstance(result.output, City)
    (path, body), *retries = requests.sent
    assert path == "/v1/chat/completions" and retries == []
    if mode == "native":
        assert body["response_format"]["type"] == "json_schema" and "tools" not in body
    else:
        assert body["tool_choice"] == "required"
        assert [t["function"]["name"] for t in body["tools"]] == ["final_result"]


# -- LangChain --------------------------------------------------------------------------------


@tool
def get_time(zone: str) -> str:
    """The current time in a time zone."""
    return f"12:00 in {zone}"


def chat_openai(server: Server, requests: Requests) -> ChatOpenAI:
    http = openai.DefaultHttpxClient(timeout=240, event_hooks={"request": [requests.record]})
    return ChatOpenAI(
        base_url=f"{server.base_url}/v1",
        api_key=KEY,  # type: ignore[arg-type]  # (a SecretStr; the str is coerced)
        model=MODEL,
        temperature=0,
        max_tokens=MAX_TOKENS,  # type: ignore[call-arg]  # (an alias of max_completion_tokens)
        max_retries=0,
        http_client=http,
    )


def assert_well_formed(message: AIMessage) -> None:
    """Each call a name and a dict of args; content beside calls is text, not whitespace."""
    assert message.invalid_tool_calls == []
    for call in message.tool_calls:
        assert call["name"] == "get_time" and isinstance(call["args"], dict)
        assert call["id"]
    assert isinstance(message.content, str)
    if message.tool_calls:
        assert message.content == "" or message.content.strip()
    else:
        assert message.content.strip()


def test_langchain_binds_a_tool_the_model_may_use(server: Server) -> None:
    requests = Requests()
    llm = chat_openai(server, requests).bind_tools([get_time])

    message = llm.invoke("What time is it in UTC?")

    assert isinstance(message, AIMessage)
    assert_well_formed(message)
    assert requests.paths() == ["/v1/chat/completions"] and "tool_choice" not in requests.sent[0][1]


@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
def test_langchain_forces_one_named_tool_call(server: Server, stream: bool) -> None:
    requests = Requests()
    llm = chat_openai(server, requests).bind_tools([get_time], tool_choice="get_time")
    prompt = "What time is it in UTC?"

    if stream:
        chunks = list(llm.stream(prompt))
        assert all(isinstance(c, AIMessageChunk) for c in chunks)
        message: AIMessage = sum(chunks[1:], chunks[0])
    else:
        message = llm.invoke(prompt)

    assert isinstance(message, AIMessage)
    assert_well_formed(message)
    (call,) = message.tool_calls
    assert isinstance(call["args"].get("zone"), str)
    (body,) = [body for _, body in requests.sent]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_time"}}
    assert body.get("stream", False) is stream


def test_langchain_sends_a_tool_result_back(server: Server) -> None:
    """The second turn of a tool loop: the assistant's call (content empty) and the tool's
    result, as LangChain writes them (role "tool", its tool_call_id)."""
    requests = Requests()
    llm = chat_openai(server, requests).bind_tools([get_time])
    call = {"name": "get_time", "args": {"zone": "UTC"}, "id": "call_0", "type": "tool_call"}
    history = [
        HumanMessage("What time is it in UTC?"),
        AIMessage("", tool_calls=[call]),
        ToolMessage("12:00 in UTC", tool_call_id="call_0"),
    ]

    message = llm.invoke(history)

    assert isinstance(message, AIMessage)
    assert_well_formed(message)
    (body,) = [body for _, body in requests.sent]
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool"]


def test_langchain_structured_output_by_json_schema(server: Server) -> None:
    requests = Requests()
    llm = chat_openai(server, requests).with_structured_output(City, method="json_schema")

    city = llm.invoke("Which city is the capital of France, and in which country?")

    assert isinstance(city, City)
    (body,) = [body for _, body in requests.sent]
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["strict"] is True
