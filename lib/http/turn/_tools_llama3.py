"""Tool calls in Llama 3.1's JSON format (`--tool-call-parser llama3_json`).

A Llama 3.1 model with its own template (which reads `tools`) answers a call as one JSON
object, ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, several
calls separated by ``; ``. A reply is a call when all of it parses as such objects;
anything else is content. Streaming holds a reply that starts like a call back until it ends
(a JSON object is only known to be a call once it closes), then sends the calls' deltas.
"""

from __future__ import annotations

import json
from typing import Any

from ._tools import ToolCall, call_deltas, compact, cut_call, new_call_id

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = "; "


TOOL_PROMPT = (
    "You can call functions. To call one, reply with only a JSON object naming the function "
    'and its parameters: {{"name": <function-name>, "parameters": <parameters-object>}}\n'
    "The functions, as JSON schemas:\n{tools}"
)


def call_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    """One call of any of `functions`: {"name": const, "parameters": its schema}."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "parameters": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    return options[0] if len(options) == 1 else {"oneOf": options}


def required_grammar(functions: list[dict[str, Any]], *, parallel: bool) -> str:
    """Lark (llguidance) for one or more calls, nothing else."""
    schema = json.dumps(compact(call_schema(functions)), separators=(",", ":"))
    repeat = f' ("{SEPARATOR}" call)*' if parallel else ""
    return f"start: call{repeat}\ncall: %json {schema}\n"


def parse_calls(text: str, names: set[str], *, cut: bool = False) -> list[ToolCall] | None:
    """The calls `text` consists of, or None when it is not (only) calls of `names`; when the
    token limit `cut` it, its last call may be incomplete (`cut_call`)."""
    rest = text.strip().removeprefix(PYTHON_TAG).lstrip()
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    while rest:
        try:
            value, end = decoder.raw_decode(rest)
        except ValueError:
            last = cut_call(rest, names) if cut else None
            return None if last is None else [*calls, last]
        if not isinstance(value, dict) or value.get("name") not in names:
            return None
        arguments = value.get("parameters", value.get("arguments", {}))
        calls.append(ToolCall(new_call_id(), value["name"], json.dumps(arguments)))
        rest = rest[end:].lstrip().removeprefix(";").lstrip()
    return calls or None


class Llama3CallStream:
    """`ToolCallStream`'s interface for the Llama 3.1 JSON format."""

    def __init__(self, names: set[str]) -> None:
        self._names = names
        self._buffer = ""
        self._holding: bool | None = None  # None: undecided (only whitespace so far)
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self._holding is False:
            return text, []
        self._buffer += text
        head = self._buffer.lstrip()
        if not head or PYTHON_TAG.startswith(head):
            return "", []
        self._holding = head.startswith(("{", PYTHON_TAG))
        if not self._holding:
            out, self._buffer = self._buffer, ""
            return out, []
        return "", []

    def finish(self, *, cut: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """The held-back reply: its calls' deltas if it was calls (the last one incomplete
        when the token limit `cut` it), else it as content."""
        text, self._buffer = self._buffer, ""
        calls = parse_calls(text, self._names, cut=cut) if self._holding else None
        if calls is None:
            return text, []
        self.calls.extend(calls)
        return "", [d for i, call in enumerate(calls) for d in call_deltas(i, call)]
