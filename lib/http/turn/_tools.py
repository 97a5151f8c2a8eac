"""Tool calling on chat completions, in the Hermes format: prompt, grammar, and parsing.

The model calls a tool by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(Hermes, Qwen2.5, and trillm's default for models whose template knows no tools, SmolLM2 among
them). `tool_choice` decides the grammar:

- ``"required"``: the output must be one call (or several, with `parallel_tool_calls`) of an
  offered function, its arguments valid under its `parameters`: a grammar of
  ``<tool_call>`` blocks around a JSON schema that is a `oneOf` of the functions.
- a named function: exactly one call of it.
- ``"auto"``: free text, with a call where the model chooses one; functions marked `strict`
  get their arguments constrained by a lazy grammar that starts at ``<tool_call>``.
- ``"none"``: no tools in the prompt, no parsing.

Why the built-in default: SmolLM2's template renders no tools; describing them in the system
turn and asking for Hermes calls is what its own fine-tune data used.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from ...engine.client import JSON_OPTIONS
from ._partial_json import parse_partial

TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # `_tools_llama3` has the second
OPEN, CLOSE = "<tool_call>", "</tool_call>"

DEFAULT_TOOL_PROMPT = (
    "You can call functions. To call one, reply with a JSON object naming the function and "
    "its arguments, inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-object>}}\n</tool_call>\n'
    "The functions, as JSON schemas:\n{tools}"
)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: its id, the function's name and its arguments (JSON text).

    An incomplete call (`complete` False) is one the token limit cut off: its arguments are
    the JSON text written so far, not valid JSON, as OpenAI shows a call that `max_tokens` ended.
    """

    id: str
    name: str
    arguments: str
    complete: bool = True


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def call_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one call of any of `functions` (OpenAI `function` objects)."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    return options[0] if len(options) == 1 else {"oneOf": options}


def compact(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with llguidance's JSON options for compact output (`JSON_OPTIONS`): inside a
    Lark grammar's ``%json`` they travel in the schema's ``x-guidance`` key."""
    return {**schema, "x-guidance": JSON_OPTIONS}


def required_grammar(functions: list[dict[str, Any]], *, parallel: bool) -> str:
    """Lark (llguidance) for one or more calls of `functions`, nothing else."""
    schema = json.dumps(compact(call_schema(functions)), separators=(",", ":"))
    repeat = ' ("\\n" call)*' if parallel else ""
    return f'start: call{repeat}\ncall: "{OPEN}\\n" %json {schema} "\\n{CLOSE}"\n'


def auto_grammar(strict: list[dict[str, Any]]) -> str | None:
    """Lark for free text where calls of `strict` functions have constrained arguments (lazy:
    the grammar holds only from ``<tool_call>`` on); None when no function is strict."""
    if not strict:
        return None
    from llguidance import StructTag

    tags = [
        StructTag(
            trigger=OPEN,
            begin=f'{OPEN}\n{{"name": {json.dumps(f["name"])}, "arguments": ',
            grammar=compact(f.get("parameters") or {"type": "object"}),
            end=f"}}\n{CLOSE}",
        )
        for f in strict
    ]
    return str(StructTag.to_grammar(tags, assume_special=False))


def tool_system_prompt(functions: list[dict[str, Any]], prompt: str = DEFAULT_TOOL_PROMPT) -> str:
    """The system text that describes `functions` to a model whose template has no tools."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in functions)
    return prompt.format(tools=listed)


def render_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template without tool support: an assistant turn's `tool_calls` become
    Hermes blocks in its content, a `tool` turn becomes a ``<tool_response>`` block."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            blocks = [
                f"{OPEN}\n"
                + json.dumps(
                    {
                        "name": c["function"]["name"],
                        "arguments": _as_object(c["function"].get("arguments")),
                    }
                )
                + f"\n{CLOSE}"
                for c in m["tool_calls"]
            ]
            content = "\n".join(filter(None, [m.get("content") or "", *blocks]))
            out.append({"role": "assistant", "content": content})
        elif m["role"] == "tool":
            out.append(
                {"role": "tool", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            )
        else:
            out.append(m)
    return out


def chat_messages(
    messages: list[dict[str, Any]],
    functions: list[dict[str, Any]],
    template_reads_tools: bool,
    prompt: str = DEFAULT_TOOL_PROMPT,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and `tools` argument for the chat template.

    A template that reads tools gets them, and calls' arguments as objects (what Hermes-style
    templates print); one that does not gets the tools described in the system turn and the
    tool turns rendered as Hermes text (`render_tool_messages`).
    """
    if template_reads_tools:
        out = []
        for m in messages:
            if m.get("tool_calls"):
                calls = [
                    {
                        **c,
                        "function": {
                            **c["function"],
                            "arguments": _as_object(c["function"].get("arguments")),
                        },
                    }
                    for c in m["tool_calls"]
                ]
                m = {**m, "tool_calls": calls}
            out.append(m)
        tools = [{"type": "function", "function": f} for f in functions] or None
        return out, tools
    rendered = render_tool_messages(messages)
    if functions:
        described = tool_system_prompt(functions, prompt)
        if rendered and rendered[0]["role"] == "system":
            content = rendered[0]["content"] + "\n\n" + described
            rendered[0] = {**rendered[0], "content": content}
        else:
            rendered.insert(0, {"role": "system", "content": described})
    return rendered, None


def parse_tool_calls(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """Split a whole completion into its content and its calls of functions in `names`
    (`ToolCallStream` fed it at once). A block that is not JSON of that shape, or names
    another function, stays in the content (what the model wrote is never lost)."""
    stream = ToolCallStream(names)
    content, _ = stream.feed(text)
    content += stream.finish()[0]
    return (content.strip(), stream.calls) if stream.calls else (text, [])


# A call's JSON up to its arguments: `{"name": "...", "arguments": ` (or "parameters").
_CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"'  # the name, a JSON string
    r'(?P<arguments>\s*,\s*"(?:arguments|parameters)"\s*:\s*)?'
)


def cut_call(body: str, names: set[str]) -> ToolCall | None:
    """The call whose JSON `body` the token limit cut off, or None when it had not named an
    offered function yet. A body whose JSON was whole (only the closing tag was cut) is a
    complete call."""
    head = _CALL_HEAD.match(body)
    if head is None:
        return None
    try:
        name = json.loads(f'"{head[1]}"')
    except ValueError:
        return None
    if name not in names:
        return None
    whole = body.rstrip()
    whole = whole[: len(whole) - _partial_suffix(whole, CLOSE)].rstrip()
    call = _call(whole, names)
    if call is not None:
        return call
    arguments = body[head.end() :] if head["arguments"] else ""
    arguments = arguments[: len(arguments) - _partial_suffix(arguments, "\n" + CLOSE)]
    try:  # whole arguments, the call's closing brace cut
        return ToolCall(new_call_id(), name, json.dumps(_as_object(json.loads(arguments))))
    except ValueError:
        return ToolCall(new_call_id(), name, arguments, complete=False)


def _opens_call(body: str, names: set[str]) -> bool:
    """Whether `body`, a call's JSON cut before its name ended, may name one of `names`."""
    if not body.strip():
        return True
    head = parse_partial(body)
    if not isinstance(head, dict) or set(head) - {"name"}:
        return False
    name = head.get("name", "")
    return isinstance(name, str) and any(n.startswith(name) for n in names)


def _call(body: str, names: set[str]) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(new_call_id(), value["name"], json.dumps(_as_object(arguments)))


def _as_object(arguments: Any) -> Any:
    """OpenAI sends arguments as JSON text; the template and our output want the object."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return {} if arguments is None else arguments


class ToolCallStream:
    """Streams a chat completion's text as content deltas and tool-call deltas.

    Text that may be the start of ``<tool_call>`` is held back; a call is emitted once its
    block closes, as two deltas: id, type and name first, then the arguments. Assembled, the
    deltas equal `parse_tool_calls` of the whole text, however it was split.
    """

    def __init__(self, names: set[str]) -> None:
        self._names = names
        self._buffer = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """New content to send and new tool-call deltas, for `text` just generated."""
        self._buffer += text
        content, deltas = [], []
        while True:
            start = self._buffer.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._buffer, OPEN)
                content.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            end = self._buffer.find(CLOSE, start)
            if end < 0:
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start:]
                break
            block = self._buffer[start : end + len(CLOSE)]
            call = _call(block[len(OPEN) : -len(CLOSE)].strip(), self._names)
            if call is None:
                content.append(self._buffer[: end + len(CLOSE)])
            else:
                content.append(self._buffer[:start])
                deltas.extend(self._deltas(call))
            self._buffer = self._buffer[end + len(CLOSE) :]
        return "".join(content), deltas

    def finish(self, *, cut: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """What is left when the completion ends. An unclosed block is content, unless the
        token limit `cut` it after it named an offered function: then it is that call,
        incomplete (its arguments as far as they came)."""
        rest, self._buffer = self._buffer, ""
        if not (cut and rest.startswith(OPEN)):
            return rest, []
        call = cut_call(rest[len(OPEN) :], self._names)
        if call is not None:
            return "", self._deltas(call)
        # Cut before it named its function: an opening that could still have become a call of
        # an offered one is neither a call nor text the model meant to say.
        return ("", []) if _opens_call(rest[len(OPEN) :], self._names) else (rest, [])

    def _deltas(self, call: ToolCall) -> list[dict[str, Any]]:
        index = len(self.calls)
        self.calls.append(call)
        return call_deltas(index, call)


def call_deltas(index: int, call: ToolCall) -> list[dict[str, Any]]:
    """A streamed call: id, type and name first, then the arguments."""
    function = {"name": call.name, "arguments": ""}
    head = {"index": index, "id": call.id, "type": "function", "function": function}
    return [head, {"index": index, "function": {"arguments": call.arguments}}]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
