"""The Responses API's stored responses: in memory, least recently used out first.

A stored response is what `GET /v1/responses/{id}` answers (its JSON, as it was sent) and
the conversation a later request continues with `previous_response_id` (its input and output
as chat messages). vLLM keeps them in memory too: a restart of the API process loses them
all, and so does a request that lands on another replica behind a router.

Two bounds hold together, so that long conversations cannot grow the lean API process without
end: `--responses-store-size` entries, and `MAX_STORE_BYTES` of what the entries keep alive.
An entry counts all it keeps (`entry_bytes`): its id, its body, and every object its
conversation reaches at CPython's own size, 16 bytes of allocator overhead each, and 256
bytes for its record and slot. A string counts its characters at CPython's width (1, 2 or 4
bytes each: one emoji makes a whole string 4) and, unless it is ASCII, the UTF-8 copy CPython
caches on it once anything encodes it. The JSON's length would be no bound: a 4 MiB body of
ASCII and one emoji decodes to a 16 MiB string, and encoding messages to measure them caches
the copies. Against tracemalloc the count is exact for text, and up to 1.8x over for
thousands of short turns or tool calls (a string they share, "" or "function", counts at
each use). An entry continuing `previous_response_id` keeps the messages of the one it
continues, the same objects, and counts them again: an over-count (entries go sooner than
they must), never an under-count, as every object kept is counted by a live entry reaching it.

What the bound holds: the entries' count is at most `MAX_STORE_BYTES`, but for the newest
entry, kept even where it alone is over (a body is at most `AppConfig.max_body_bytes`, 4 MiB,
which keeps about 20 MiB at most: one long text with an emoji, or 150,000 empty turns, which
count 30). The resident size grows by more: the request in hand (its body and decoded text),
and what glibc's malloc keeps: once a large string is freed its mmap threshold rises to that
size, later ones come from the heap, and freed heap pages stay for reuse.
`tests/http/test_responses_store.py` fills a 64 MiB store with 4 MiB bodies: 84 MiB of peak
growth measured with `MALLOC_MMAP_THRESHOLD_=131072` (held to 64 + 32 MiB), 102 MiB with
glibc's defaults (held to 2 x 64 + 32 MiB); by those ratios about 0.45 GiB at the default
256 MiB.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from ..edge._errors import RequestError

MAX_STORE_BYTES = 256 << 20
_COMPACT_HEADER = sys.getsizeof("\xe9") - 2  # a non-ASCII str's header: "\xe9" is it, 1 byte, NUL
_OBJECT_OVERHEAD = 16  # an allocation's header and rounding, pymalloc's or malloc's
_ENTRY_OVERHEAD = 256  # the StoredResponse, its __dict__, the OrderedDict's slot and link


@dataclass(frozen=True)
class StoredResponse:
    """A response's body, and its conversation as chat messages (input, then output)."""

    body: bytes
    messages: tuple[Any, ...]  # _requests.ChatMessage


def held_bytes(*objects: object) -> int:
    """The bytes `objects` and everything they reach hold in CPython's heap, or a little more.

    Walks msgspec Structs (the chat messages, their parts and tool calls), lists, tuples and
    dicts (a tool call's arguments may be a JSON object) with a stack, not recursion, as deep
    as the JSON nests. An object reached twice counts twice; None is not counted (there is one).
    """
    total, stack = 0, list(objects)
    while stack:
        obj = stack.pop()
        if obj is None:
            continue
        if isinstance(obj, str):
            total += str_bytes(obj) + _OBJECT_OVERHEAD
            continue
        total += sys.getsizeof(obj) + _OBJECT_OVERHEAD
        if isinstance(obj, msgspec.Struct):
            stack.extend(msgspec.structs.astuple(obj))
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
    return total


def str_bytes(text: str) -> int:
    """What `text` holds: its characters at CPython's width, and, when it is not ASCII, the
    UTF-8 copy CPython caches on it once anything encodes it, whether that happened yet or not.
    """
    if text.isascii():
        return sys.getsizeof(text)  # its characters are its UTF-8: no copy is ever made
    utf8 = len(text.encode("utf-8", "surrogatepass")) + 1
    # sys.getsizeof counts the copy once it is cached: then the two agree
    return max(sys.getsizeof(text), _COMPACT_HEADER + (len(text) + 1) * _width(text) + utf8)


def _width(text: str) -> int:
    """The bytes each character of `text` takes in CPython: its widest character's.

    Found by encoding at C speed (a copy, dropped at once); `max(text)` makes a str per
    character, 30x slower.
    """
    try:
        text.encode("latin-1")
    except UnicodeEncodeError:
        astral = len(text.encode("utf-16-le", "surrogatepass")) > 2 * len(text)
        return 4 if astral else 2
    return 1


def entry_bytes(response_id: str, stored: StoredResponse) -> int:
    """What keeping `stored` under `response_id` costs the store's byte bound."""
    return held_bytes(response_id, stored.body, stored.messages) + _ENTRY_OVERHEAD


class _Deleted(msgspec.Struct):
    id: str
    object: str = "response"
    deleted: bool = True


class ResponseStore:
    """Responses by id, up to `size` of them (0: none is kept)."""

    def __init__(self, size: int, max_bytes: int = MAX_STORE_BYTES) -> None:
        if size < 0:
            raise ValueError(f"--responses-store-size must be >= 0, got {size}")
        self.size, self.max_bytes = size, max_bytes
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self._bytes = 0  # the sum of the entries' `entry_bytes`
        # Background responses in progress (`pin`): never evicted, or a poll would 404 while
        # the run goes on; at most --responses-store-size of them run at once.
        self._pinned: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        """What the entries hold, as `entry_bytes` counts it (the bound is `max_bytes`)."""
        return self._bytes

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keep `stored`; the least recently used go while a bound is passed (never one
        pinned, nor `stored` itself: the bounds hold again once the pins are released)."""
        if not self.enabled:
            return
        self._drop(response_id)
        size = entry_bytes(response_id, stored)
        self._entries[response_id] = (stored, size)
        self._bytes += size
        self._evict(keep=response_id)

    def pin(self, response_id: str) -> None:
        """Keep `response_id` whatever the bounds until `unpin` (a background run's)."""
        self._pinned.add(response_id)

    def unpin(self, response_id: str) -> None:
        self._pinned.discard(response_id)
        self._evict(keep=response_id)

    def _evict(self, keep: str) -> None:
        while len(self._entries) > self.size or (
            self._bytes > self.max_bytes and len(self._entries) > 1
        ):
            victim = next((k for k in self._entries if k not in self._pinned and k != keep), None)
            if victim is None:
                return
            self._drop(victim)

    def conversation(self, response_id: str) -> StoredResponse:
        """The stored response `previous_response_id` names.

        Raises:
            RequestError: 404 (param `previous_response_id`) when it is not stored.
        """
        stored = self._find(response_id, "previous_response_id")
        self._entries.move_to_end(response_id)
        return stored

    def get(self, response_id: str) -> bytes:
        """The body of a stored response (`GET /v1/responses/{id}`).

        Raises:
            RequestError: 404 when it is not stored.
        """
        return self._find(response_id, None).body

    def delete(self, response_id: str) -> bytes:
        """Forget a stored response; the body says so (`DELETE /v1/responses/{id}`).

        Raises:
            RequestError: 404 when it is not stored.
        """
        self._find(response_id, None)
        self._drop(response_id)
        return msgspec.json.encode(_Deleted(response_id))

    def _find(self, response_id: str, param: str | None) -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None:
            raise self._missing(response_id, param)
        return entry[0]

    def _drop(self, response_id: str) -> None:
        old = self._entries.pop(response_id, None)
        if old is not None:
            self._bytes -= old[1]

    def _missing(self, response_id: str, param: str | None) -> RequestError:
        why = (
            "this server stores no responses (--responses-store-size 0)"
            if not self.enabled
            else "it was never stored (store: false), was deleted, was evicted "
            "(--responses-store-size), or the server restarted since"
        )
        return RequestError(
            404, f"no response {response_id!r} is stored: {why}", param=param, code="not_found"
        )
