"""The Responses face's routes: `POST /v1/responses`, and `GET`, `DELETE` and `POST .../cancel`
of a stored response (`/v1/responses/{id}`).

Creating one reads, admits, decodes and checks its request with the app's steps
(`edge.Edge`); a stored one is answered from the store, or its background run cancelled.
"""

from __future__ import annotations

from typing import Any

from ..edge._errors import RequestError
from ..edge._steps import Edge, Receive, Scope, Send
from ._api import ResponsesAPI, ResponsesRequest

ITEM_PREFIX = "/v1/responses/"  # GET and DELETE of a stored response


class ResponsesRoutes:
    """The Responses handlers of one app (its route table names them)."""

    def __init__(self, edge: Edge, responses: ResponsesAPI) -> None:
        self.edge = edge
        self.responses = responses

    async def create(self, scope: Scope, receive: Receive, send: Send, extra: list[Any]) -> None:
        async with self.edge.open(scope, receive, ResponsesRequest) as (request, held):
            rank = self.edge.rank(scope, None)
            await self.responses.create(request, held, receive, send, extra, rank=rank)

    async def get(self, scope: Scope, receive: Receive, send: Send, extra: list[Any]) -> None:
        stored = self.responses.store.get(scope["path"][len(ITEM_PREFIX) :])
        await self.edge.respond(send, 200, stored, extra)

    async def delete(self, scope: Scope, receive: Receive, send: Send, extra: list[Any]) -> None:
        body = self.responses.store.delete(scope["path"][len(ITEM_PREFIX) :])
        await self.edge.respond(send, 200, body, extra)

    async def cancel(self, scope: Scope, receive: Receive, send: Send, extra: list[Any]) -> None:
        response_id, _, rest = scope["path"][len(ITEM_PREFIX) :].partition("/")
        if rest != "cancel":
            raise RequestError(405, f"method POST is not allowed on {scope['path']}")
        body = await self.responses.background.cancel(response_id)
        await self.edge.respond(send, 200, body, extra)
