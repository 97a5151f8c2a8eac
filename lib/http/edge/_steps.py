"""The app's steps every route takes, lent to the faces' routes: `Edge`, and a header's value.

The app imports every face to build its route table, so a face's routes cannot import the app:
the app hands them its own steps instead, and each is read and admitted as any other route.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
S = TypeVar("S")


class Decode(Protocol):
    async def __call__(self, body: bytes, kind: type[S], /) -> S: ...


@dataclass(frozen=True, slots=True)
class Edge:
    """The app's steps every route takes (`_app.App` hands its own): read the body, decode it,
    admit the request (503 dead or draining, 429 full), check the model, pin the engine
    (`rank`: the `X-data-parallel-rank` header, or the body's `data_parallel_rank` where the
    face has one; `_rank.pinned_rank`), respond. So a face's request is read, admitted and
    pinned as any other without reaching into the app."""

    read_body: Callable[[Scope, Any], Awaitable[bytes]]
    decode: Decode
    admitted: Callable[[], AbstractContextManager[Any]]
    check_model: Callable[[str | None], None]
    rank: Callable[[Scope, int | None], int | None]
    respond: Callable[[Send, int, bytes, list[tuple[bytes, bytes]]], Awaitable[None]]


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None
