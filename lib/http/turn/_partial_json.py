"""The value a cut-off JSON text had reached, for a tool call that the token limit ended.

A client shown a call cut off by `max_tokens` gets its arguments as the text written so far
(OpenAI's `arguments` string, the Responses API's, an Anthropic stream's `partial_json`), but
Anthropic's whole message carries `input` as an object: this is that object, as the anthropic
SDK's own accumulator (jiter's partial mode) would make it from the same stream. Open strings
and containers are closed; a member or element whose value was not complete is dropped.
"""

from __future__ import annotations

import json
from typing import Any

MAX_TRIES = 64  # parses tried from the end back; each is linear in the text


def parse_partial(text: str) -> Any:
    """The longest completion of a prefix of `text` that parses; None when none does.

    The whole text is tried first, closed; then the text cut before each of its last commas
    and after each of its last opening brackets, closed (at most `MAX_TRIES` parses).
    """
    closers: list[str] = []
    in_string = escaped = False
    cuts: list[tuple[int, str]] = []  # (where to cut, what then closes it)
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            closers.append("}" if ch == "{" else "]")
            cuts.append((i + 1, "".join(reversed(closers))))
        elif ch in "}]":
            if closers:
                closers.pop()
        elif ch == "," and closers:
            cuts.append((i, "".join(reversed(closers))))
    whole = text[:-1] if escaped else text
    candidates = [whole + ('"' if in_string else "") + "".join(reversed(closers))]
    candidates += [text[:end] + tail for end, tail in reversed(cuts[-(MAX_TRIES - 1) :])]
    for candidate in candidates:
        try:
            return json.loads(candidate)
        except ValueError:
            continue
    return None
