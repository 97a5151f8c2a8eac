"""Per-request incremental detokenisation and stop strings, in the frontend.

`IncrementalDetokenizer` turns each step's new tokens into the new text they complete;
`StopChecker` cuts that text at the first stop string, holding back what could still become
one. Both are plain, per-request state machines, called once per step from the output pump,
so their cost per token bounds the frontend's throughput: neither ever looks at the whole
text generated so far.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output (vLLM's initial offset)
_REPLACEMENT = "\ufffd"  # what a decode gives for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """The text of a request's output, produced token by token.

    Concatenating what `push` returns, then `flush`, gives
    `tokenizer.decode(output_ids, skip_special_tokens=...)`; for tokenizers whose decode
    strips the first token's leading space (SentencePiece's "▁"), the space is kept, as the
    prompt's last tokens are decoded ahead of the output (as vLLM does).

    Built on `tokenizers`' `DecodeStream` (in Rust): each step decodes a window of a few
    tokens, the previous chunk's (the prefix) and the new ones, and returns the decoded text
    beyond the prefix's, unless it ends in U+FFFD: an incomplete UTF-8 sequence is held until
    the tokens that complete it arrive. The window is mirrored here (`_ids`, `_read_end`)
    only so that `flush` can release held tokens when the request ends.
    """

    __slots__ = ("_flushed", "_ids", "_read_end", "_skip_special_tokens", "_stream", "_tokenizer")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        """Start after the prompt.

        Args:
            tokenizer: the fast tokenizer (`tokenizers.Tokenizer`, a transformers fast
                tokenizer's `backend_tokenizer`).
            prompt_token_ids: the prompt; its last few tokens give the first output token's
                context.
            skip_special_tokens: leave special tokens (EOS, chat markers) out of the text.
        """
        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        # A context ending in an incomplete character would have output tokens complete it,
        # changing text already decoded: drop such tokens (the output decodes on its own).
        while context and tokenizer.decode(context, skip_special_tokens).endswith(_REPLACEMENT):
            context.pop()
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        # The stream's window: _ids[:_read_end] decoded to its prefix; _ids[_read_end:] held.
        self._ids = context
        self._read_end = len(context)
        self._flushed = False

    def push(self, token_ids: Sequence[int], /) -> str:
        """Append `token_ids`; returns the new text they complete ("" while it is incomplete).

        Raises:
            RuntimeError: called after `flush`.
        """
        if self._flushed:
            raise RuntimeError("push after flush: the request's output is over")
        if not token_ids:
            return ""
        ids = self._ids
        ids += token_ids
        step = token_ids[0] if len(token_ids) == 1 else list(token_ids)
        text = self._stream.step(self._tokenizer, step)
        if text is None:
            return ""
        # The stream now keeps the tokens since the previous chunk as its prefix.
        del ids[: self._read_end]
        self._read_end = len(ids)
        return text

    def flush(self) -> str:
        """The text of held tokens, at the end of the request (U+FFFD for what is incomplete).

        Call once, when the request finished; `push` fails afterwards.
        """
        self._flushed = True
        ids, read_end = self._ids, self._read_end
        if read_end == len(ids):
            return ""
        decode = self._tokenizer.decode
        prefix = decode(ids[:read_end], self._skip_special_tokens)
        self._read_end = len(ids)
        return decode(ids, self._skip_special_tokens)[len(prefix) :]

    @property
    def num_held_tokens(self) -> int:
        """Output tokens whose text is not out yet (they end in an incomplete character)."""
        return len(self._ids) - self._read_end


class StopChecker:
    """Cuts a request's text at its first stop string, across token and step boundaries.

    `feed` emits text only once it cannot become part of a stop string: a suffix that is
    the start of one is held back until later text decides. The first stop string to
    complete wins (the one ending first in the text; of those ending together, the
    longest), whatever way the text was split into feeds. Nothing after it is emitted.
    Held text is always shorter than the longest stop string, so a feed costs
    O(len(new_text) + longest stop string) per stop string.
    """

    __slots__ = ("_held", "_include_stop_str_in_output", "_stop_string", "_stops")

    def __init__(
        self, stop_strings: Sequence[str], include_stop_str_in_output: bool = False
    ) -> None:
        """Watch for `stop_strings`.

        Args:
            stop_strings: non-empty strings (already validated by `SamplingParams`).
            include_stop_str_in_output: emit the stop string itself before stopping.

        Raises:
            ValueError: a stop string is empty.
        """
        if not all(stop_strings):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(dict.fromkeys(stop_strings))
        self._include_stop_str_in_output = include_stop_str_in_output
        self._held = ""
        self._stop_string: str | None = None

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, or None while none has."""
        return self._stop_string

    @property
    def held_text(self) -> str:
        """Text held back as a possible start of a stop string."""
        return self._held

    def feed(self, new_text: str, /) -> tuple[str, bool]:
        """Take the next text; returns (text to emit now, whether a stop string ended it).

        After the stop, every feed returns ("", True).
        """
        if self._stop_string is not None:
            return "", True
        text = self._held + new_text if self._held else new_text
        if not text:
            return "", False
        # The held text contains no stop string, so any match ends in new_text.
        match_start = match_end = len(text) + 1
        for stop in self._stops:
            start = text.find(stop)
            if start != -1:
                end = start + len(stop)
                if end < match_end or (end == match_end and start < match_start):
                    match_start, match_end, self._stop_string = start, end, stop
        if self._stop_string is not None:
            self._held = ""
            return text[: match_end if self._include_stop_str_in_output else match_start], True
        hold = self._hold_start(text)
        self._held = text[hold:]
        return text[:hold], False

    def flush(self) -> str:
        """Release the held text: the request ended for another reason (EOS, length)."""
        held, self._held = self._held, ""
        return held

    def _hold_start(self, text: str) -> int:
        """Where the longest suffix of `text` that begins some stop string starts."""
        hold = len(text)
        for stop in self._stops:
            # Candidates: a suffix shorter than `stop`, starting with its first character,
            # before the best start so far.
            first = stop[0]
            i = text.find(first, max(0, len(text) - len(stop) + 1), hold)
            while i != -1:
                if stop.startswith(text[i:]):
                    hold = i
                    break
                i = text.find(first, i + 1, hold)
        return hold
