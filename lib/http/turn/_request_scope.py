"""A generation request's scope and timing.

`RequestScope` cancels the request when its client disconnects (a task on ASGI `receive()`)
or at the drain deadline of a graceful shutdown; `run_all` runs a request's prompts together
and raises the first real error as itself; `RequestTiming` measures time to first token and
the gaps between tokens for the metrics.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ...engine.client import Output

Receive = Callable[[], Awaitable[dict[str, Any]]]


class RequestTiming:
    """When a request's tokens arrived: time to first token and the gaps between tokens."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.ttft: float | None = None
        self.itl: list[float] = []
        self._last: float | None = None

    def saw(self, output: Output) -> None:
        if not output.token_ids:
            return
        now = time.monotonic()
        if self._last is None:
            self.ttft = now - self.started
        else:
            self.itl.append((now - self._last) / len(output.token_ids))
        self._last = now


class RequestScope:
    """Cancels the request when the client disconnects, or at the drain deadline."""

    def __init__(self, generation: Any, receive: Receive) -> None:
        self.generation = generation
        self.receive = receive
        self.scope = trio.CancelScope()
        self._nursery_cm: Any = None

    async def __aenter__(self) -> trio.CancelScope:
        generation = self.generation
        generation.scopes.add(self.scope)
        if generation.draining:
            self.scope.deadline = generation.drain_deadline
        self._nursery_cm = trio.open_nursery()
        nursery = await self._nursery_cm.__aenter__()
        nursery.start_soon(self._watch)
        self._watcher = nursery.cancel_scope
        self.scope.__enter__()
        return self.scope

    async def __aexit__(self, *exc_info: Any) -> bool:
        try:
            suppressed = self.scope.__exit__(*exc_info)
        finally:
            self._watcher.cancel()
            await self._nursery_cm.__aexit__(None, None, None)
            self.generation.scopes.discard(self.scope)
        return bool(suppressed)

    async def _watch(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.scope.cancel()
                return


def bind(fn: Callable[..., Awaitable[None]], *args: Any) -> Callable[[], Awaitable[None]]:
    async def call() -> None:
        await fn(*args)

    return call


async def run_all(jobs: list[Callable[[], Awaitable[None]]]) -> None:
    """Run `jobs` concurrently; raise the first real error as itself (not as a group)."""
    if len(jobs) == 1:
        await jobs[0]()
        return
    try:
        async with trio.open_nursery() as nursery:
            for job in jobs:
                nursery.start_soon(job)
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        real = [e for e in leaves if not isinstance(e, trio.Cancelled)]
        raise (real or leaves)[0] from None


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out
