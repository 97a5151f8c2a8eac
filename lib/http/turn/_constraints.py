"""The request fields that constrain an output, and the one grammar they make together.

- `structured_outputs` (vLLM's field, completions and chat): `json`, `regex`, `choice`,
  `grammar`, `json_object`.
- `response_format` (OpenAI, chat and completions): `text`, `json_object`, `json_schema`.
- `tools` with `tool_choice` (chat): see `_tools`.

At most one of `structured_outputs` and a non-text `response_format` may be given (400
otherwise). Tools combine with `response_format`: under `tool_choice="auto"` the output is
either tool calls or content that follows the format; under `"required"` or a named function
it is calls only (the format applies to the answer of a later turn).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec

from ...engine.client import StructuredOutputs
from ..edge._errors import RequestError
from . import _tools as T
from . import _tools_llama3 as L3

# OpenAI's rule for a format's name (it answers 400 otherwise): a label, like a function's.
FormatName = Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9_-]{1,64}$")]


class JsonSchemaFormat(msgspec.Struct, frozen=True):
    """`strict` false is served as true: the grammar holds the schema either way (a
    non-strict request asks for the schema at best, and an output that follows it is one).
    `name` and `description` are labels that vLLM, too, gives no other use."""

    name: FormatName = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, frozen=True):
    type: str
    json_schema: JsonSchemaFormat | None = None

    def __post_init__(self) -> None:
        if self.type not in ("text", "json_object", "json_schema"):
            raise RequestError(
                400,
                f"response_format.type must be 'text', 'json_object' or 'json_schema', got "
                f"{self.type!r}",
                param="response_format.type",
            )
        if self.type == "json_schema" and self.json_schema is None:
            raise RequestError(
                400,
                "response_format of type 'json_schema' needs 'json_schema'",
                param="response_format.json_schema",
            )

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the content must follow (None for `text`)."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema" and self.json_schema is not None:
            return self.json_schema.schema or {"type": "object"}
        return None


class FunctionDef(msgspec.Struct, frozen=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 64:
            raise RequestError(
                400,
                f"a function name must be 1 to 64 characters, got {self.name!r}",
                param="tools",
            )


class Tool(msgspec.Struct, frozen=True):
    type: str
    function: FunctionDef

    def __post_init__(self) -> None:
        if self.type != "function":
            raise RequestError(400, f"tools of type {self.type!r} are not supported", param="tools")


class NamedFunction(msgspec.Struct, frozen=True):
    name: str


class NamedToolChoice(msgspec.Struct, frozen=True):
    type: str
    function: NamedFunction

    def __post_init__(self) -> None:
        if self.type != "function":
            raise RequestError(
                400,
                f"tool_choice names a tool of type {self.type!r}: only 'function' tools are served",
                param="tool_choice.type",
            )


ToolChoice = str | NamedToolChoice


def function_dicts(tools: list[Tool]) -> list[dict[str, Any]]:
    return [msgspec.to_builtins(t.function) for t in tools]


def tool_choice_mode(tools: list[Tool] | None, choice: ToolChoice | None) -> str:
    """ "none", "auto", "required" or "named", after checking `choice` against `tools`."""
    if choice is None:
        return "auto" if tools else "none"
    if not tools:
        if choice == "none":
            return "none"
        raise RequestError(400, "tool_choice needs tools: send the tools to choose from",
                           param="tool_choice")  # fmt: skip
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise RequestError(
                400,
                f"tool_choice must be 'none', 'auto', 'required' or a named function, got "
                f"{choice!r}",
                param="tool_choice",
            )
        return choice
    names = [t.function.name for t in tools]
    if choice.function.name not in names:
        raise RequestError(
            400,
            f"tool_choice names the function {choice.function.name!r}, which is not among "
            f"the tools ({', '.join(names)})",
            param="tool_choice",
        )
    return "named"


def constraint(
    *,
    structured_outputs: StructuredOutputs | None,
    response_format: ResponseFormat | None,
    tools: list[Tool] | None = None,
    tool_choice: ToolChoice | None = None,
    parallel_tool_calls: bool = True,
    tool_format: str = "hermes",
) -> StructuredOutputs | None:
    """The one constraint of a request's output, or None for free text.

    Raises:
        RequestError: 400 for two structured fields at once, or a bad tool choice.
    """
    schema = response_format.schema() if response_format is not None else None
    if structured_outputs is not None and schema is not None:
        raise RequestError(
            400,
            "send one of structured_outputs and response_format, not both",
            param="response_format",
        )
    mode = tool_choice_mode(tools, tool_choice)
    functions = function_dicts(tools or [])
    llama3 = tool_format == "llama3_json"
    required_grammar = L3.required_grammar if llama3 else T.required_grammar
    if mode in ("required", "named"):
        if structured_outputs is not None:
            raise RequestError(
                400,
                f"tool_choice {mode!r} and structured_outputs both constrain the output: send one",
                param="structured_outputs",
            )
        parallel = parallel_tool_calls
        if mode == "named":  # exactly one call of that function, as OpenAI and vLLM make
            assert isinstance(tool_choice, NamedToolChoice)  # tool_choice_mode checked it
            functions = [f for f in functions if f["name"] == tool_choice.function.name]
            parallel = False
        return StructuredOutputs(grammar=required_grammar(functions, parallel=parallel))
    if mode == "auto" and schema is not None:
        calls = required_grammar(functions, parallel=parallel_tool_calls)
        content = json.dumps(T.compact(schema), separators=(",", ":"))
        grammar = calls.replace("start: call", "start: answer | call", 1)
        return StructuredOutputs(grammar=grammar + f"answer: %json {content}\n")
    if mode == "auto":
        # Lazy constraints need a trigger: Hermes has <tool_call>, Llama 3's bare JSON none.
        if structured_outputs is not None:
            return structured_outputs
        strict = [f for f in functions if f.get("strict")] if not llama3 else []
        lazy = T.auto_grammar(strict)
        return StructuredOutputs(grammar=lazy) if lazy is not None else None
    if structured_outputs is not None:
        return structured_outputs
    return StructuredOutputs(json=schema) if schema is not None else None
