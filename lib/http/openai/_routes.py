"""The OpenAI face's generation routes: `POST /v1/completions` and `/v1/chat/completions`.

Each reads, admits, decodes and checks its request with the app's steps (`edge.Edge`), pins
it to the data-parallel rank its header or body asks for, and runs it
(`_stream.CompletionRunner`).
"""

from __future__ import annotations

from typing import Any

from ..edge._steps import Edge, Receive, Scope, Send
from ..turn._generate import Generation
from ._requests import ChatCompletionRequest, CompletionRequest
from ._stream import CompletionRunner


class CompletionRoutes:
    """The completions and chat completions handlers of one app (its route table names them)."""

    def __init__(self, edge: Edge, generation: Generation) -> None:
        self.edge = edge
        self.runner = CompletionRunner(generation)

    async def completions(
        self, scope: Scope, receive: Receive, send: Send, extra: list[Any]
    ) -> None:
        async with self.edge.open(scope, receive, CompletionRequest) as (request, held):
            request.data_parallel_rank = self.edge.rank(scope, request.data_parallel_rank)
            await self.runner.completions(request, receive, send, extra, held)

    async def chat(self, scope: Scope, receive: Receive, send: Send, extra: list[Any]) -> None:
        async with self.edge.open(scope, receive, ChatCompletionRequest) as (request, held):
            request.data_parallel_rank = self.edge.rank(scope, request.data_parallel_rank)
            await self.runner.chat(request, receive, send, extra, held)
