"""The Anthropic face's routes: `POST /v1/messages` and `/v1/messages/count_tokens`.

Each reads, decodes and checks its request with the app's steps (`edge.Edge`); a message is
admitted as generation, a count as `/tokenize` is (`light`: it holds a tokenizer thread).
"""

from __future__ import annotations

from typing import Any

from ..edge._steps import Edge, Receive, Scope, Send
from ._api import MessagesAPI
from ._schema import CountTokensRequest, MessagesRequest


class MessagesRoutes:
    """The Messages handlers of one app (its route table names them)."""

    def __init__(self, edge: Edge, messages: MessagesAPI) -> None:
        self.edge = edge
        self.messages = messages

    async def create(self, scope: Scope, receive: Receive, send: Send, extra: list[Any]) -> None:
        async with self.edge.open(scope, receive, MessagesRequest) as (request, held):
            rank = self.edge.rank(scope, None)
            await self.messages.create(request, held, receive, send, extra, rank=rank)

    async def count_tokens(
        self, scope: Scope, receive: Receive, send: Send, extra: list[Any]
    ) -> None:
        # as /tokenize: it holds a tokenizer thread
        async with self.edge.open(scope, receive, CountTokensRequest, light=True) as (request, _):
            answer = await self.messages.count_tokens(request)
        await self.edge.respond(send, 200, answer, extra)
