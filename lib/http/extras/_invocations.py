"""`POST /invocations` (SageMaker's one route), as vLLM routes it: by the body's shape.

A body with `messages` is a chat completion, one with `prompt` a completion, one with
`input` an embedding; the route's own handler then reads the same body, and errors in its own
words. Anything else is a 400 saying which fields pick a route.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from ..edge._errors import RequestError

Receive = Callable[[], Awaitable[dict[str, Any]]]


_shape = msgspec.json.Decoder(dict[str, msgspec.Raw])  # the values stay undecoded
ROUTES = (
    ("messages", "/v1/chat/completions"),
    ("prompt", "/v1/completions"),
    ("input", "/v1/embeddings"),
)


def invocation_route(body: bytes) -> str:
    """The route `body` is for.

    Raises:
        RequestError: 400 when it is not a JSON object with messages, prompt or input.
    """
    try:
        fields = _shape.decode(body)
    except msgspec.DecodeError:
        fields = {}
    for name, route in ROUTES:
        if name in fields:
            return route
    raise RequestError(
        400,
        "an /invocations body needs messages (chat completions), prompt (completions) or "
        "input (embeddings)",
    )


def replayed(body: bytes, receive: Receive) -> Receive:
    """`receive` that gives `body` first, as if it arrived again; then the client's messages
    (its disconnect)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
