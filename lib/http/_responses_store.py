"""The Responses API's stored responses: in memory, least recently used out first.

A stored response is what `GET /v1/responses/{id}` answers (its JSON, as it was sent) and
the conversation a later request continues with `previous_response_id` (its input and output
as chat messages). vLLM keeps them in memory too: a restart of the API process loses them
all, and so does a request that lands on another replica behind a router.

Two bounds hold together: `--responses-store-size` entries, and `MAX_STORE_BYTES` of JSON
(an entry's size is its body's length twice over, a fair bound on the messages it keeps
beside it), so that a long conversation cannot grow the lean API process without end.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from ._errors import RequestError

MAX_STORE_BYTES = 256 << 20


@dataclass(frozen=True)
class StoredResponse:
    """A response's body, and its conversation as chat messages (input, then output)."""

    body: bytes
    messages: tuple[Any, ...]  # _requests.ChatMessage


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
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keep `stored`; the least recently used go while a bound is passed."""
        if not self.enabled:
            return
        self._drop(response_id)
        self._entries[response_id] = stored
        self._bytes += 2 * len(stored.body)
        while len(self._entries) > self.size or (
            self._bytes > self.max_bytes and len(self._entries) > 1
        ):
            self._drop(next(iter(self._entries)))

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
        stored = self._entries.get(response_id)
        if stored is None:
            raise self._missing(response_id, param)
        return stored

    def _drop(self, response_id: str) -> None:
        old = self._entries.pop(response_id, None)
        if old is not None:
            self._bytes -= 2 * len(old.body)

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
