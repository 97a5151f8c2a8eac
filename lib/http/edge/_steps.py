"""The app's steps every route takes, lent to the faces' routes: `Edge`, and a header's value.

The app imports every face to build its route table, so a face's routes cannot import the app:
the app hands them its own steps instead, and each is read and admitted as any other route.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
S = TypeVar("S")


class Open(Protocol):
    """A route's prologue, once for every route: read the body, admit the request (as
    generation, or `light` as one tokenizer call), decode it as `kind`, check its model;
    the block runs with the request and its share of the queue."""

    def __call__(
        self, scope: Scope, receive: Receive, kind: type[S], /, *, light: bool = False
    ) -> AbstractAsyncContextManager[tuple[S, Any]]: ...


@dataclass(frozen=True, slots=True)
class Edge:
    """The app's steps every route takes (`_app.App` hands its own): `open` reads the body,
    admits the request (503 dead or draining, 429 full), decodes it and checks its model;
    `rank` pins it to an engine (the `X-data-parallel-rank` header, or the body's
    `data_parallel_rank` where the face has one: `_rank.pinned_rank`); `respond` answers. So
    a face's request is read, admitted and pinned as any other, in one place, without
    reaching into the app."""

    open: Open
    rank: Callable[[Scope, int | None], int | None]
    respond: Callable[[Send, int, bytes, list[tuple[bytes, bytes]]], Awaitable[None]]


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None
