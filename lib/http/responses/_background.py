"""Background responses (`background: true`): a run that outlives its request's connection.

`POST /v1/responses` answers at once with the response `in_progress` (stored, so that
`GET /v1/responses/{id}` polls it); the turn runs in this object's nursery, which the server
opens beside hypercorn's (`App.run_background`), and stores the response again when it ends:
completed, incomplete, failed, or cancelled by `POST /v1/responses/{id}/cancel`.

Bounded as requests are: a run keeps its request's share of --max-queued-requests (it counts
as in flight until it ends) and at most --responses-store-size runs go at once (their results
must have a place to be kept). A graceful shutdown gives runs the drain deadline, as it does
open requests; a run it ends is stored failed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from ..edge._admission import Held
from ..edge._errors import RequestError, http_error, internal_error
from ..turn._generate import ChatPlan, Generation
from ..turn._turn import TurnBlocks
from ..turn._turn_runner import feed_turn
from ._face import ResponsesFace
from ._store import ResponseStore

log = logging.getLogger("trillm.http")


@dataclass
class _Run:
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)


async def _never_disconnects() -> dict[str, Any]:
    await trio.sleep_forever()
    raise AssertionError("unreachable")


class BackgroundResponses:
    """The background runs of one app, by response id."""

    def __init__(self, generation: Generation, store: ResponseStore) -> None:
        self.generation = generation
        self.store = store
        self.running: dict[str, _Run] = {}
        self._nursery: trio.Nursery | None = None

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the runs' nursery until cancelled (the server's shutdown ends the runs left)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def start(self, face: ResponsesFace, plan: ChatPlan, held: Held) -> bytes:
        """Store the response in progress, start its run, and return the body to answer.

        Raises:
            RequestError: 503 when no nursery serves runs; 429 when --responses-store-size
                runs go already.
        """
        if self._nursery is None:
            raise RequestError(503, "background responses are not served now", "server_error")
        if len(self.running) >= self.store.size:
            raise RequestError(
                429,
                f"{len(self.running)} background responses are running, as many as "
                f"--responses-store-size keeps; retry when one has finished",
                code="rate_limit_exceeded",
            )
        turn = TurnBlocks(plan.turn_parser())
        body = face.kept(turn, "in_progress")
        self.store.pin(face.id)  # polled until it ends: never evicted meanwhile
        # The run takes over the request's share of the queue, which the request then frees
        # as nothing: it is counted once, from admission to the run's end.
        release = held.hand_over()
        self.generation.inflight += 1
        run = self.running[face.id] = _Run()
        self._nursery.start_soon(self._run, face, plan, turn, run, release)
        return body

    def is_running(self, response_id: str) -> bool:
        return response_id in self.running

    async def cancel(self, response_id: str) -> bytes:
        """End a running response; its body, status "cancelled".

        Raises:
            RequestError: 404 when it is not stored; 400 when it is not running.
        """
        run = self.running.get(response_id)
        if run is None:
            status = json.loads(self.store.get(response_id)).get("status")
            raise RequestError(
                400,
                f"response {response_id!r} is {status}: only a background response in "
                f"progress can be cancelled",
                param="response_id",
            )
        run.scope.cancel()
        await run.done.wait()
        return self.store.get(response_id)

    async def _run(
        self,
        face: ResponsesFace,
        plan: ChatPlan,
        turn: TurnBlocks,
        run: _Run,
        release: Callable[[], None],
    ) -> None:
        generation = self.generation
        try:
            error: RequestError | None = None
            with run.scope:
                try:
                    async with generation.running(_never_disconnects) as scope:
                        await feed_turn(generation, plan, turn, None)
                    if scope.cancelled_caught:  # only the drain deadline cancels it
                        error = RequestError(503, "the server is shutting down", "server_error")
                except Exception as exc:
                    error = http_error(exc)
                    if error is None:
                        log.exception("internal error in a background response")
                        error = internal_error(exc)
            if run.scope.cancelled_caught:
                face.kept(turn, "cancelled")
            elif error is not None:
                code = "server_error" if error.status >= 500 else "invalid_prompt"
                face.kept(turn, "failed", error={"code": code, "message": error.message})
            else:
                face.whole(turn)
        finally:
            release()
            generation.inflight -= 1
            del self.running[face.id]
            self.store.unpin(face.id)
            run.done.set()


def check_background(request: Any, store: ResponseStore) -> None:
    """OpenAI's rule: a background response is stored; and this server runs it unstreamed.

    Raises:
        RequestError: 400 naming `store` or `stream`.
    """
    if request.store is False or not store.enabled:
        why = "store is false" if request.store is False else "--responses-store-size is 0"
        raise RequestError(
            400, f"background needs store: true ({why}): its result is polled", param="store"
        )
    if request.stream:
        raise RequestError(
            400,
            "background with stream is not supported: poll GET /v1/responses/{id} instead",
            param="stream",
        )


async def respond(send: Any, status: int, body: bytes, extra: list[Any]) -> None:
    headers = [(b"content-type", b"application/json"), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
