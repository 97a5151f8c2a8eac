"""Runs one assistant turn for an API whose output is blocks (Responses, Anthropic Messages).

The request was translated into a chat request and planned (`Generation.plan_chat`): its
prompt is rendered and checked, so from here on a failure is the stream's error event, or the
whole response's status. `run_turn` feeds the turn's outputs to `TurnBlocks`, whole or
streamed, under the same disconnect and shutdown rules as chat completions (`RequestScope`);
a `Face` names the events and bodies of one API, and nothing else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from ..edge._errors import RequestError, http_error, internal_error
from ._generate import JSON, SSE_HEADERS, ChatPlan, Generation
from ._request_scope import RequestTiming
from ._turn import BlockEvent, TurnBlocks

log = logging.getLogger("trillm.http")
Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


class Face(Protocol):
    """One API's wire shape for a turn: its whole body, and its stream's events as bytes."""

    def whole(self, turn: TurnBlocks) -> bytes:
        """The whole response's body."""
        ...

    def started(self, turn: TurnBlocks) -> bytes:
        """The stream's first events (before any output)."""
        ...

    def events(self, turn: TurnBlocks, events: list[BlockEvent]) -> bytes:
        """The stream's events for the blocks' events (b"" for none)."""
        ...

    def ended(self, turn: TurnBlocks) -> bytes:
        """The stream's last events, once the turn finished."""
        ...

    def failed(self, turn: TurnBlocks, error: RequestError) -> bytes:
        """The stream's last events when `error` ended it."""
        ...


async def run_turn(
    generation: Generation,
    plan: ChatPlan,
    face: Face,
    *,
    stream: bool,
    receive: Receive,
    send: Send,
    extra: list[Any],
) -> None:
    """Run `plan`'s one choice and answer with `face`'s body or stream."""
    turn = TurnBlocks(plan.turn_parser())
    if stream:
        await _streamed(generation, plan, face, turn, receive, send, extra)
        return
    async with generation.running(receive) as scope:
        await _generate(generation, plan, turn, None)
    if scope.cancelled_caught:
        if generation.draining:
            raise RequestError(503, "the server is shutting down", "server_error")
        return  # the client went away: nobody to answer
    body = face.whole(turn)
    with trio.move_on_after(generation.last_write_timeout()):
        await send({"type": "http.response.start", "status": 200, "headers": JSON + extra})
        await send({"type": "http.response.body", "body": body})


async def _streamed(
    generation: Generation,
    plan: ChatPlan,
    face: Face,
    turn: TurnBlocks,
    receive: Receive,
    send: Send,
    extra: list[Any],
) -> None:
    async def write(data: bytes) -> None:
        if data:  # the connection bounds its writes (`--write-timeout`), as in chat
            await send({"type": "http.response.body", "body": data, "more_body": True})

    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + extra})
    await write(face.started(turn))
    error: RequestError | None = None
    try:
        async with generation.running(receive) as scope:
            await _generate(generation, plan, turn, lambda events: write(face.events(turn, events)))
        if scope.cancelled_caught and generation.draining:
            error = RequestError(503, "the server is shutting down", "server_error")
        elif scope.cancelled_caught:
            return  # the client went away
    except Exception as exc:  # as the whole response's status would be (`http_error`)
        error = http_error(exc)
        if error is None:
            log.exception("internal error in a stream")
            error = internal_error(exc)
    with trio.move_on_after(generation.last_write_timeout()):
        last = face.failed(turn, error) if error is not None else face.ended(turn)
        await send({"type": "http.response.body", "body": last, "more_body": False})


async def _generate(
    generation: Generation,
    plan: ChatPlan,
    turn: TurnBlocks,
    emit: Callable[[list[BlockEvent]], Awaitable[None]] | None,
) -> None:
    """Feed the turn its outputs; `emit` its events as they come (a stream), every
    `--stream-interval` tokens at least, as chat completions' chunks."""
    (prepared,) = plan.prepared
    timing = RequestTiming(time.monotonic())
    interval = generation.config.stream_interval
    pending: list[BlockEvent] = []
    held_tokens = 0
    finished = False
    try:
        async with generation.llm.generate(prepared) as outputs:
            async for output in outputs:
                timing.saw(output)
                events = turn.feed(output)
                if output.finished:
                    finished = True
                    generation.observe(output, timing)
                if emit is None:
                    continue
                pending += events
                held_tokens += len(output.token_ids)
                if pending and (held_tokens >= interval or output.finished):
                    batch, pending, held_tokens = pending, [], 0
                    await emit(batch)
    finally:  # a disconnect, a slow reader, a shutdown or an error ended it
        if not finished:
            generation.metrics.count_aborted(1)


feed_turn = _generate  # a background response's run (`responses/_background`) feeds its turn
