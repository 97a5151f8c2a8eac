"""A chat choice's text split into reasoning, content and tool calls, whole or as it streams.

Reasoning parsers (`--reasoning-parser`), as vLLM names them:
- ``deepseek_r1``: the reply starts inside the reasoning (the template opened ``<think>``);
  everything up to ``</think>`` is reasoning (a leading ``<think>`` is dropped too).
- ``qwen3``: reasoning only inside an explicit ``<think>...</think>`` at the start.
Text that may be the start of a tag is held back while streaming, so no tag leaks into a
delta. The content then goes through the tool-call parser when the request has tools. An
output constraint applies after the reasoning (the engine's mask: `after_reasoning`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...engine.client import REASONING_PARSERS
from ._tools import ToolCall, ToolCallStream, _partial_suffix
from ._tools_llama3 import Llama3CallStream

THINK, END_THINK = "<think>", "</think>"


@dataclass
class ChatParts:
    """New text of each kind, and new tool-call deltas."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: ChatParts) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls


class ChatOutputParser:
    """One choice's parser. `feed` the text as it comes; `finish` once it ended."""

    def __init__(
        self,
        *,
        reasoning_parser: str | None,
        tool_names: set[str] | None,
        tool_format: str = "hermes",
    ) -> None:
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {reasoning_parser!r}: use one of "
                f"{', '.join(REASONING_PARSERS)}"
            )
        self._mode = reasoning_parser
        # "start": nothing seen yet; "reasoning": inside; "content": past the reasoning
        self._state = "start" if reasoning_parser else "content"
        self._held = ""
        self._strip = False  # drop the newlines between </think> and the content
        self._tools: ToolCallStream | Llama3CallStream | None = None
        self._blank = ""  # content whitespace held back: a call may follow it
        self._said = False  # whether any content was sent
        if tool_names:
            stream = Llama3CallStream if tool_format == "llama3_json" else ToolCallStream
            self._tools = stream(tool_names)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [] if self._tools is None else self._tools.calls

    def feed(self, text: str) -> ChatParts:
        parts = ChatParts()
        self._held += text
        while self._held:
            if self._state == "start":
                if THINK.startswith(self._held) and len(self._held) < len(THINK):
                    return parts  # maybe the opening tag
                if self._held.startswith(THINK):
                    self._held = self._held[len(THINK) :]
                    self._state = "reasoning"
                else:
                    self._state = "reasoning" if self._mode == "deepseek_r1" else "content"
            elif self._state == "reasoning":
                end = self._held.find(END_THINK)
                if end < 0:
                    keep = _partial_suffix(self._held, END_THINK)
                    parts.reasoning += self._held[: len(self._held) - keep]
                    self._held = self._held[len(self._held) - keep :]
                    return parts
                parts.reasoning += self._held[:end]
                self._held = self._held[end + len(END_THINK) :]
                self._state, self._strip = "content", True
            else:
                if self._strip:
                    self._held = self._held.lstrip("\n")
                    self._strip = not self._held
                parts.add(self._content(self._held))
                self._held = ""
        return parts

    def finish(self, *, cut: bool = False) -> ChatParts:
        """The rest: held-back text, an unclosed tag's text, as what it was inside. `cut`: the
        token limit ended the choice, so an unclosed call is an incomplete call, not text."""
        parts = ChatParts()
        held, self._held = self._held, ""
        if self._state == "reasoning":
            parts.reasoning += held
        elif held:
            parts.add(self._content(held))
        if self._tools is not None:
            content, deltas = self._tools.finish(cut=cut)
            parts.add(ChatParts(content=self._unblank(content), tool_calls=deltas))
            if not self._tools.calls:  # no call came: the whitespace was content after all
                parts.content += self._blank
            self._blank = ""
        return parts

    def _content(self, text: str) -> ChatParts:
        if self._tools is None:
            return ChatParts(content=text)
        content, deltas = self._tools.feed(text)
        return ChatParts(content=self._unblank(content), tool_calls=deltas)

    def _unblank(self, content: str) -> str:
        """`content` with its trailing whitespace held back until text follows it. The
        whitespace around and between calls (the separator the grammar writes) is no
        content: the whole response strips it, so a stream must not send it either."""
        text = self._blank + content
        if not self._said and self.tool_calls:  # the content starts after a call: strip it
            text = text.lstrip()
        body = text.rstrip()
        self._blank = text[len(body) :]
        self._said = self._said or bool(body)
        return body
