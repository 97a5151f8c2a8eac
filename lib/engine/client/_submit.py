"""`open_request`: one request's children sent to an engine, and aborted there if left early.

Generation and pooling submit alike: each child is opened in the output processor before
its ADD is sent (so no record about it is missed), counted in its engine's load, and on
exit, however it comes (the end, break, exception, cancellation), each child not finished
is forgotten and aborted in the engine (DESIGN.md §8: a request whose consumer leaves is
aborted). Written once here so the two cannot drift apart.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import trio

from .engines._engine_client import EngineClient
from .engines._engine_pool import EnginePool
from .outputs._output_processor import RequestState


def _as_is(state: RequestState) -> None:
    pass


@asynccontextmanager
async def open_request(
    engines: EnginePool,
    engine: EngineClient,
    states: Sequence[RequestState],
    fill: Callable[[RequestState], None] = _as_is,
) -> AsyncIterator[None]:
    """ADD `states` (one request's children) to `engine`, each from its own fields, once
    `fill` (called just before its ADD) set them; on exit forget the unfinished ones and
    abort them in the engine.

    Raises:
        EngineDeadError: `engine` died before an ADD went out.
        trio.BrokenResourceError: the request ring broke while the engine still serves.
        What `fill` raises (the children are aborted all the same).
    """
    processor = engines.processor
    for state in states:
        state.engine = engine.index
        processor.add(state)
    loads = engines.router.loads
    loads[engine.index] += len(states)
    try:
        for state in states:
            fill(state)
            try:
                await engine.send_add(
                    state.rnum,
                    state.options,
                    state.max_tokens,
                    state.prompt_token_ids,
                    state.grammar,
                    cache_salt=state.cache_salt,
                    prompt_embeds=state.prompt_embeds,
                    lora_id=state.lora_id,
                )
            except trio.BrokenResourceError:
                engines.check_engine(engine)
                raise
            state.on_engine = True
        yield
    finally:
        loads[engine.index] -= len(states)
        unfinished = [s.rnum for s in states if not s.finished]
        for rnum in unfinished:
            processor.forget(rnum)
        if unfinished and not engine.dead:
            # it may die meanwhile: its requests are gone with it
            gone = (trio.BrokenResourceError, trio.ClosedResourceError)
            with trio.CancelScope(shield=True), contextlib.suppress(*gone):
                await engine.send_abort(unfinished)
