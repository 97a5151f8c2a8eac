"""The Anthropic face's routes: `POST /v1/messages` and `/v1/messages/count_tokens`.

Each reads, decodes and checks its request with the app's steps (`edge.Edge`); a message is
admitted as generation, a count as `/tokenize` is (`hold`: it holds a tokenizer thread).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ..edge._steps import Edge, Receive, Scope, Send
from ._api import MessagesAPI
from ._schema import CountTokensRequest, MessagesRequest


class MessagesRoutes:
    """The Messages handlers of one app (its route table names them).

    `hold` admits at weight 1 without the generation checks (`Admission.hold`)."""

    def __init__(
        self, edge: Edge, messages: MessagesAPI, hold: Callable[[], AbstractContextManager[Any]]
    ) -> None:
        self.edge = edge
        self.messages = messages
        self.hold = hold

    async def create(self, scope: Scope, receive: Receive, send: Send, extra: list[Any]) -> None:
        body = await self.edge.read_body(scope, receive)
        with self.edge.admitted() as held:
            request = await self.edge.decode(body, MessagesRequest)
            self.edge.check_model(request.model)
            rank = self.edge.rank(scope, None)
            await self.messages.create(request, held, receive, send, extra, rank=rank)

    async def count_tokens(
        self, scope: Scope, receive: Receive, send: Send, extra: list[Any]
    ) -> None:
        body = await self.edge.read_body(scope, receive)
        with self.hold():  # as /tokenize: it holds a tokenizer thread
            request = await self.edge.decode(body, CountTokensRequest)
            self.edge.check_model(request.model)
            answer = await self.messages.count_tokens(request)
        await self.edge.respond(send, 200, answer, extra)
