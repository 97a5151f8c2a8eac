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
# Held tokens past which the window is settled. A character has at most 4 bytes, so text
# holds at most 3 tokens (more only with tokens without text between its bytes, skipped
# special tokens, and a settle keeps a started character held anyway).
MAX_HELD_TOKENS = 8
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
    the tokens that complete it arrive. The window is mirrored here (`_ids`, `_read_end`) so
    that `flush` can release held tokens when the request ends, and so that it can be
    settled: output that never completes a character (lone continuation bytes, which a
    client can force with `logit_bias`) would grow the window forever, each step decoding
    all of it. Past `MAX_HELD_TOKENS` held tokens, the held text is released as a full decode
    shows it (U+FFFD for the invalid bytes), but for the tokens that may start a character;
    the request then goes on with the same rule applied here (`_step_settled`), since the
    stream's state cannot be set. So a step decodes at most about 10 tokens.
    """

    __slots__ = (
        "_flushed",
        "_ids",
        "_prefix",
        "_read_end",
        "_skip_special_tokens",
        "_skipped",
        "_stream",
        "_tokenizer",
    )

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
        # None once settled: then `_step_settled` does its work, with `_prefix` its prefix.
        self._stream: DecodeStream | None = DecodeStream(
            ids=context, skip_special_tokens=skip_special_tokens
        )
        self._prefix = ""
        self._skipped: frozenset[int] | None = None  # computed when a settle needs it
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
        if self._stream is None:
            return self._step_settled()
        step = token_ids[0] if len(token_ids) == 1 else list(token_ids)
        text = self._stream.step(self._tokenizer, step)
        if text is None:
            if len(ids) - self._read_end > MAX_HELD_TOKENS:
                prefix = self._decode(ids[: self._read_end])
                return self._settle(self._decode(ids), prefix)
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
        prefix = self._prefix if self._stream is None else self._decode(ids[:read_end])
        self._read_end = len(ids)
        return self._decode(ids)[len(prefix) :]

    @property
    def num_held_tokens(self) -> int:
        """Output tokens whose text is not out yet (they end in an incomplete character)."""
        return len(self._ids) - self._read_end

    def _step_settled(self) -> str:
        """`DecodeStream.step`'s rule, over the window here: the text past the prefix's, once
        it does not end in U+FFFD; the new tokens then become the prefix."""
        ids = self._ids
        text, prefix = self._decode(ids), self._prefix
        if len(text) > len(prefix) and not text.endswith(_REPLACEMENT):
            del ids[: self._read_end]
            self._read_end = len(ids)
            self._prefix = self._decode(ids)
            return text[len(prefix) :]
        if len(ids) - self._read_end > MAX_HELD_TOKENS:
            return self._settle(text, prefix)
        return ""

    def _settle(self, whole: str, prefix: str) -> str:
        """Release the held tokens as a full decode shows them, but for a few at the end; go
        on with `_step_settled`.

        `whole` and `prefix` are the window's text and its prefix's. Held tokens that add no
        text (skipped special tokens) leave the window first; if enough remain, the cut is
        the latest place with text after it where decoding the two sides apart gives
        `whole`: never inside a character or an invalid sequence (its bytes decode to more
        U+FFFD apart), nor before a started character's bytes, which stay held. So the text
        released is final: for byte-level tokenizers exactly what `tokenizer.decode` gives.
        Where no place fits, the cut keeps the last token only: the window stays bounded,
        the text approximate.
        """
        read_end, skipped = self._read_end, self._skipped_ids()
        ids = [*self._ids[:read_end], *(i for i in self._ids[read_end:] if i not in skipped)]
        self._stream, self._ids, self._prefix = None, ids, prefix
        if len(ids) - read_end <= MAX_HELD_TOKENS:
            return ""
        decode = self._decode
        cut = len(ids) - 1
        for split in range(cut, read_end, -1):
            head, rest = decode(ids[:split]), decode(ids[split:])
            if rest and head + rest == whole:
                cut = split
                break
        else:
            head = decode(ids[:cut])
        # What comes next decodes after the token before the cut, so that its leading space
        # is not taken for the start of a text.
        del ids[: cut - 1]
        self._read_end = 1
        self._prefix = decode(ids[:1])
        return head[len(prefix) :]

    def _skipped_ids(self) -> frozenset[int]:
        """The special tokens, if they are skipped: ids that add no text to a decode."""
        if self._skipped is None:
            added = self._tokenizer.get_added_tokens_decoder().items()
            skip = self._skip_special_tokens
            self._skipped = frozenset(i for i, token in added if skip and token.special)
        return self._skipped

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, self._skip_special_tokens)


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
