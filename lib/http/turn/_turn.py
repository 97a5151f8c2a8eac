"""One assistant turn as ordered blocks: the output model the Responses and Messages APIs share.

Chat completions streams a turn as deltas (`_chat_output.ChatParts`); the Responses API
(output items: `reasoning`, `message`, `function_call`) and Anthropic's Messages API (content
blocks: `thinking`, `text`, `tool_use`) both show it as a list of blocks, each opened, grown
and closed. `TurnBlocks` makes those blocks from the one chat parser (reasoning and tool calls
parsed once, by `ChatOutputParser`), so each API's module only names its events: a whole
response is the same blocks, fed the same way and read at the end.

Blocks in a turn come in the order the model wrote them. Within one fed piece, reasoning comes
before content and content before the calls it preceded: the parser holds a call back until
its block closes, and the text that follows a call is content of a later block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from ...engine.client import Output, TokenLogprob
from ._chat_output import ChatOutputParser
from ._tools import ToolCall

BlockKind = Literal["reasoning", "text", "tool_call"]


@dataclass
class Block:
    """One block of a turn: reasoning or text (its `text` so far), or a whole tool call.

    `complete` is False for the block the token limit cut off (a call's arguments then are
    the JSON text written so far).
    """

    kind: BlockKind
    index: int
    text: str = ""
    call: ToolCall | None = None
    complete: bool = True
    # a text block's tokens' logprobs, when asked: those of each output that grew it
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class BlockEvent:
    """A block opened ("start"), grew by `delta` ("delta"), or closed ("stop")."""

    kind: Literal["start", "delta", "stop"]
    block: Block
    delta: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()  # a text delta's tokens', when asked


@dataclass
class TurnCounts:
    """Token counts of a turn, for each API's usage record."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # tokens of outputs that added reasoning and nothing else


@dataclass
class TurnBlocks:
    """A turn's blocks from its outputs as they come (`feed`), closed at its end."""

    parser: ChatOutputParser
    blocks: list[Block] = field(default_factory=list)
    counts: TurnCounts = field(default_factory=TurnCounts)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    _open: Block | None = None
    _calls_seen: int = 0
    _held_logprobs: list[TokenLogprob] = field(default_factory=list)

    def feed(self, output: Output) -> list[BlockEvent]:
        """The events for `output` (one engine output of the turn's only choice)."""
        parts = self.parser.feed(output.text)
        cut = output.finish_reason == "length"
        if output.finished:
            parts.add(self.parser.finish(cut=cut))
        c = self.counts
        c.prompt_tokens = max(c.prompt_tokens, output.num_prompt_tokens)
        c.output_tokens = max(c.output_tokens, output.num_output_tokens)
        c.cached_tokens = max(c.cached_tokens, output.num_cached_tokens)
        if parts.reasoning and not (parts.content or parts.tool_calls):
            c.reasoning_tokens += len(output.token_ids)
        events: list[BlockEvent] = []
        if parts.reasoning:
            events += self._grow("reasoning", parts.reasoning)
        # The parser may hold text back (a possible tool call, a stop string): the tokens
        # of an output that showed nothing go with the text that shows next.
        logprobs = self._held_logprobs + (output.logprobs or [])
        self._held_logprobs = []
        if parts.content:
            events += self._grow("text", parts.content, logprobs)
        elif not (parts.reasoning or parts.tool_calls):
            self._held_logprobs = logprobs
        for call in self.parser.tool_calls[self._calls_seen :]:
            events += self._close()
            block = Block("tool_call", len(self.blocks), call=call, complete=call.complete)
            self.blocks.append(block)
            events += [BlockEvent("start", block), BlockEvent("delta", block, call.arguments)]
            events.append(BlockEvent("stop", block))
        self._calls_seen = len(self.parser.tool_calls)
        if output.finished:
            if cut and self._open is not None:
                self._open.complete = False
            events += self._close()
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
        return events

    @property
    def called(self) -> bool:
        """Whether the turn called a tool."""
        return any(b.kind == "tool_call" for b in self.blocks)

    @property
    def text(self) -> str:
        """The turn's text blocks joined (the Responses API's `output_text`)."""
        return "".join(b.text for b in self.blocks if b.kind == "text")

    def _grow(
        self, kind: BlockKind, text: str, logprobs: Sequence[TokenLogprob] = ()
    ) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        block = self._open
        if block is None or block.kind != kind:
            events += self._close()
            block = self._open = Block(kind, len(self.blocks))
            self.blocks.append(block)
            events.append(BlockEvent("start", block))
        block.text += text
        block.logprobs += logprobs
        events.append(BlockEvent("delta", block, text, tuple(logprobs)))
        return events

    def _close(self) -> list[BlockEvent]:
        block, self._open = self._open, None
        return [BlockEvent("stop", block)] if block is not None else []
