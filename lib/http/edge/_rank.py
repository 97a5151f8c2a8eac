"""Which engine a request is pinned to, under `--data-parallel-size` > 1: vLLM's
`X-data-parallel-rank` header, or the body's `data_parallel_rank` (vLLM's extra field).

Checked before anything runs, so a bad one is a 400 naming where it came from: a header that
is not an integer, a rank outside [0, data-parallel size), or a header and a body that name
different engines. A router in front of several engines (llm-d, vllm-router) sends the header
to keep a session's prefix on one engine; the body field is for clients that cannot set
headers.
"""

from __future__ import annotations

import re

from ._errors import RequestError

HEADER = "X-data-parallel-rank"
FIELD = "data_parallel_rank"
_INTEGER = re.compile(rb"\s*(-?[0-9]{1,18})\s*")


def pinned_rank(header: bytes | None, body: int | None, size: int) -> int | None:
    """The engine the request asks for (None: the router chooses).

    Args:
        header: the `X-data-parallel-rank` header's value, if sent.
        body: the body's `data_parallel_rank`, if sent.
        size: the number of engines (`--data-parallel-size`).

    Raises:
        RequestError: 400 naming the header or the field.
    """
    rank = body
    if header is not None:
        match = _INTEGER.fullmatch(header)
        if match is None:
            shown = header[:40].decode("latin-1")
            raise RequestError(
                400, f"the {HEADER} header must be an integer, got {shown!r}", param=HEADER
            )
        rank = int(match[1])
        if body is not None and body != rank:
            raise RequestError(
                400,
                f"the {HEADER} header ({rank}) and {FIELD} ({body}) name different engines: "
                f"send one of them",
                param=FIELD,
            )
    if rank is not None and not 0 <= rank < size:
        name = f"the {HEADER} header" if header is not None else FIELD
        raise RequestError(
            400,
            f"{name} must be in [0, {size}) (--data-parallel-size {size}), got {rank}",
            param=HEADER if header is not None else FIELD,
        )
    return rank
