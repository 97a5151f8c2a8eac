"""Resuming a dead engine's requests on its successor, and finding the one that killed it.

The frontend owns every request's prompt and every token streamed so far, so a restarted
engine gets each open request again: the prompt plus those tokens, the remaining budget
(`resend`). A request that kills every engine it runs on (a poison request: a token that
crashes a kernel, a grammar that crashes the matcher) must not take the server through all
its restarts, nor take the requests that merely shared its batch with it. `judge` tells
them apart from what each death names:

- The DEAD record names the requests of the step that raised (`RemoteError.step_rnums`);
  a death without one (a signal, a stall) blames every request on the engine.
- A blamed request counts one more death in a row; one on the engine but not blamed starts
  again from zero.
- At its second death in a row, a request that is the only one there is poison: it fails,
  its error saying how often it was resumed. Several there (batch-mates every time) are
  quarantined: each is resumed alone among them, one after the other (`release_quarantined`),
  beside the unsuspected requests, so the next death blames exactly one of them.
- A quarantined request in the failing step, the only one there, is poison (it ran there
  alone among the suspects). The newest goes first: the requests that ran through many steps
  before the first death are the less likely cause.
- Once the poison is found, its batch-mates are cleared: they resume together as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import msgspec
import trio

from .._errors import EngineDeadError
from ..outputs._output_processor import OutputProcessor, RequestState
from ._engine_client import EngineClient

# How often a quarantine turn looks whether its request has ended (any of five places ends
# one: finish, abort by its client, a stop string, a failure, a death; a poll sees them all).
QUARANTINE_POLL_S = 0.005


@dataclasses.dataclass(slots=True)
class Judgement:
    """What a death means for each request its engine held."""

    resume: list[RequestState]  # resent at once
    quarantined: list[RequestState]  # resent one at a time (`release_quarantined`)
    poison: list[RequestState]  # failed: not resumed again


def judge(states: Iterable[RequestState], step_rnums: list[int] | None) -> Judgement:
    """Count this death against the requests the dead engine held; say which are poison."""
    held = list(states)
    blamed = None if step_rnums is None else set(step_rnums)
    ran = [s for s in held if s.on_engine]  # the rest waited for a quarantine turn
    for state in ran:
        state.on_engine = False
        state.deaths = state.deaths + 1 if blamed is None or state.rnum in blamed else 0
    loners = [s for s in ran if s.quarantined and s.deaths]
    repeat = [s for s in ran if s.deaths >= 2]
    poison = loners if len(loners) == 1 else repeat if len(repeat) == 1 else []
    rest = [s for s in held if s not in poison]
    if poison:  # found: it clears its batch-mates
        for state in rest:
            state.quarantined, state.deaths = False, 0
    else:
        for state in repeat:
            state.quarantined = True
    return Judgement(
        resume=[s for s in rest if not s.quarantined],
        quarantined=[s for s in rest if s.quarantined],
        poison=poison,
    )


def poison_error(dead: EngineDeadError, state: RequestState) -> EngineDeadError:
    """`dead`, saying the request was resumed and is not resumed again."""
    error = EngineDeadError(dead.error)
    times = state.deaths - 1
    resumed = "once" if times == 1 else "twice" if times == 2 else f"{times} times"
    error.args = (
        f"{dead} (this request was in the engine's batch at {state.deaths} deaths in a row "
        f"and was resumed {resumed}; it is not resumed again)",
    )
    return error


async def resend(engine: EngineClient, state: RequestState) -> None:
    """ADD `state` to `engine` again: prompt + tokens streamed so far, the same budget and
    cache salt (a resumed request must not read another tenant's blocks, nor leave its own
    to them), its LoRA adapter, and its prompt's embeddings when it was sent as such.

    A seeded request continues from a derived seed (seed + tokens so far): the dead
    engine's generator position is gone with it. Prompt logprobs were already streamed.
    """
    options = state.options
    if state.token_ids:
        seed = None if options.seed is None else options.seed + len(state.token_ids)
        options = msgspec.structs.replace(options, seed=seed, prompt_logprobs=None)
    ids = [*state.prompt_token_ids, *state.token_ids]
    await engine.send_add(
        state.rnum,
        options,
        state.max_tokens,
        ids,
        state.grammar,
        len(state.token_ids),
        cache_salt=state.cache_salt,
        prompt_embeds=state.prompt_embeds,
        lora_id=state.lora_id,
    )
    state.on_engine = True


async def release_quarantined(engine: EngineClient, processor: OutputProcessor) -> None:
    """Resend `engine`'s quarantined requests one at a time (the newest first), each after
    the last ended; stop when the engine dies (its successor takes the rest)."""
    while not engine.dead:
        waiting = [
            s for s in processor.of_engine(engine.index) if s.quarantined and not s.on_engine
        ]
        if not waiting:
            return
        state = max(waiting, key=lambda s: s.rnum)  # the newest first
        try:
            await resend(engine, state)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # it died meanwhile: its death is being handled
        while processor.get(state.rnum) is state and not engine.dead:
            await trio.sleep(QUARANTINE_POLL_S)
