"""How deep a JSON text nests, measured on its bytes before anything parses it.

Why: msgspec and `json` decode by recursion, so a body of 3,000 nested arrays is a
`RecursionError` (a 500), and one just under their limit decodes, only to overflow whatever
recurses over it next (`msgspec.to_builtins`, a chat template's `tojson`). A request is
refused first instead, with the limit in its message (`MAX_JSON_DEPTH`: the real schemas
and tool calls of the tests nest under 40 levels, body included; 256 leaves any recursion
after the decode hundreds of frames of room below Python's 1,000).

The measure is vectorised, not a loop in Python: escaped backslashes and quotes are dropped,
every byte but `"[]{}` is dropped, and over what is left a running count of quotes tells
which brackets stand inside strings; the depth is the largest running sum of the others
(numpy, which the engine client already imports). About 40 ms for the worst 4 MiB body on
this machine's cores, most of it with the GIL released; nothing for a body with fewer
brackets than the limit (the usual case), which cannot nest deeper than their count.
"""

from __future__ import annotations

import numpy as np

MAX_JSON_DEPTH = 256  # arrays and objects, one inside another, the body's own included

_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'"[]{}')
_STEP = np.zeros(256, np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_QUOTE = ord('"')


def nests_deeper(text: bytes | str, limit: int) -> bool:
    """Whether the JSON `text` has more than `limit` arrays and objects one inside another
    (brackets inside strings do not count). Text that is not JSON gets an answer too, which
    does not matter: the decoder refuses it."""
    data = text.encode() if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    if b"\\" in data:  # `\\` first, so that the `\"` left are the escaped quotes
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    kept = np.frombuffer(data.translate(None, _NOT_STRUCTURE), np.uint8)
    inside = np.cumsum(kept == _QUOTE, dtype=np.int32) & 1  # odd: within a string
    steps = np.where(inside == 0, _STEP[kept], 0).astype(np.int32)
    return int(np.cumsum(steps).max(initial=0)) > limit
