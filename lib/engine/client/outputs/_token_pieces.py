"""Each token's own bytes and text, as logprobs show them.

`convert_ids_to_tokens` gives a tokenizer's internal pieces: byte-level BPE writes a space as
"Ġ" and a newline as "Ċ", sentencepiece writes "▁" and byte fallbacks as "<0x0A>". A logprob
entry must show what the token adds to the text (vLLM's and OpenAI's `token`), and `bytes`
must be those bytes in UTF-8, so a client can join tokens that split a character. So each
token's bytes are recovered from its piece (the byte-level alphabet inverted, byte fallbacks
read, "▁" as a space), once per token id, and its text is those bytes decoded (a token that
holds part of a character shows U+FFFD, and its bytes tell the rest).
"""

from __future__ import annotations

import re
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character map, inverted: the character byte-level BPE writes for each
    byte (printable ASCII and Latin-1 as themselves, the rest shifted past 255)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, shifted = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


class TokenPieces:
    """`pieces(token_id)` is a token's text, `pieces.bytes_of(token_id)` its bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        decoder = tokenizer.backend_tokenizer.decoder
        self._byte_level = "ByteLevel" in repr(decoder)
        self._special = set(tokenizer.all_special_ids)
        self._alphabet = _byte_level_alphabet()
        self._bytes: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="replace")

    def bytes_of(self, token_id: int) -> bytes:
        found = self._bytes.get(token_id)
        if found is None:
            found = self._bytes[token_id] = self._piece_bytes(token_id)
        return found

    def _piece_bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:  # an id past the vocabulary the tokenizer knows (padding rows)
            return b""
        if token_id in self._special:
            return str(piece).encode()
        if self._byte_level and all(c in self._alphabet for c in piece):
            return bytes(self._alphabet[c] for c in piece)
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback is not None:
            return bytes([int(fallback.group(1), 16)])
        return str(piece).replace("\u2581", " ").encode()


class TokenIds:
    """`TokenPieces`' interface with each token shown as "token_id:N" (vLLM's
    `return_tokens_as_token_ids`, for clients that must tell tokens of equal text apart)."""

    def __init__(self, pieces: TokenPieces) -> None:
        self._pieces = pieces

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def bytes_of(self, token_id: int) -> bytes:
        return self._pieces.bytes_of(token_id)
