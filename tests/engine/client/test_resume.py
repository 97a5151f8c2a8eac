"""`judge`: which request a death is blamed on, told from its batch-mates; `resend`: what a
resumed request carries (no processes)."""

from __future__ import annotations

from typing import Any

import msgspec

from trillm.common.wire import SamplingOptions
from trillm.engine.client._errors import EngineDeadError
from trillm.engine.client.engines._connection import EngineConnection
from trillm.engine.client.engines._resume import judge, poison_error, resend
from trillm.engine.client.outputs._output_processor import RequestState
from trillm.engine.client.outputs._outputs import Mailbox
from trillm.engine.protocol import RemoteError
from trillm.engine.protocol import _messages as P


def states(n: int) -> list[RequestState]:
    return [
        RequestState(
            rnum=r,
            index=0,
            mailbox=Mailbox(),
            detokenizer=None,  # type: ignore[arg-type]
            stop=None,
            num_prompt_tokens=1,
            logprobs=None,
            on_engine=True,
        )
        for r in range(1, n + 1)
    ]


def send(held: list[RequestState]) -> None:
    """What a restart does: every request but the quarantined goes back on the engine."""
    for state in held:
        state.on_engine = not state.quarantined


def test_one_death_blames_nobody() -> None:
    held = states(3)
    verdict = judge(held, [1, 2, 3])
    assert verdict.resume == held and not verdict.quarantined and not verdict.poison
    assert [s.deaths for s in held] == [1, 1, 1]


def test_the_only_request_at_two_deaths_in_a_row_is_poison() -> None:
    held = states(3)
    judge(held, [1, 2, 3])
    send(held)
    verdict = judge(held, [2])  # 1 and 3 were not in the step: cleared
    assert [s.rnum for s in verdict.poison] == [2]
    assert [s.rnum for s in verdict.resume] == [1, 3]
    assert [s.deaths for s in verdict.resume] == [0, 0]


def test_a_death_without_a_step_blames_every_request() -> None:
    held = states(1)
    judge(held, None)
    send(held)
    assert [s.rnum for s in judge(held, None).poison] == [1]


def test_batch_mates_at_two_deaths_are_quarantined_then_the_lone_culprit_is_found() -> None:
    held = states(4)
    judge(held, [1, 2, 3, 4])
    send(held)
    verdict = judge(held, [1, 2, 3, 4])
    assert not verdict.poison and verdict.quarantined == held and not verdict.resume
    # The newest quarantined request runs alone (among them) and kills the engine again.
    for state in held:
        state.on_engine = state.rnum == 4
    verdict = judge(held, [4])
    assert [s.rnum for s in verdict.poison] == [4]
    assert [s.rnum for s in verdict.resume] == [1, 2, 3]  # cleared: they resume together
    assert not any(s.quarantined or s.deaths for s in verdict.resume)


def test_a_quarantined_request_outside_the_failing_step_is_not_blamed() -> None:
    held = states(3)
    judge(held, [1, 2, 3])
    send(held)
    judge(held, [1, 2, 3])  # all quarantined
    for state in held:
        state.on_engine = state.rnum == 3
    verdict = judge(held, [])  # a death in a step without it
    assert not verdict.poison and held[2].deaths == 0 and held[0].deaths == 2
    assert [s.rnum for s in verdict.quarantined] == [1, 2, 3]


def test_the_poison_error_names_the_cause_and_the_resumes() -> None:
    held = states(1)
    judge(held, [1])
    send(held)
    (state,) = judge(held, [1]).poison
    dead = EngineDeadError(RemoteError("engine", "InjectedFault", "boom"))
    message = str(poison_error(dead, state))
    assert message == (
        "the engine died: InjectedFault in engine: boom (this request was in the engine's "
        "batch at 2 deaths in a row and was resumed once; it is not resumed again)"
    )


class _Recorder:
    """An engine that keeps the ADD records it is sent, encoded as the real client does."""

    def __init__(self) -> None:
        self.records: list[bytearray] = []

    async def send_add(self, *args: Any, **kwargs: Any) -> None:
        record = EngineConnection().encode_add(*args, **kwargs)
        payload = bytearray(record.size)
        record.write(memoryview(payload))
        self.records.append(payload)


async def test_a_resumed_request_keeps_its_cache_salt_and_prompt_embeddings() -> None:
    (state,) = states(1)
    state.options, state.max_tokens, state.cache_salt = SamplingOptions(), 8, "tenant-a"
    state.prompt_embeds = bytes(range(24))
    state.prompt_token_ids, state.token_ids = [5, 6, 7], [8, 9]
    engine = _Recorder()
    await resend(engine, state)  # type: ignore[arg-type]
    header, tokens = P.unpack_add(
        memoryview(engine.records[0]), msgspec.msgpack.Decoder(P.AddHeader)
    )
    assert header.cache_salt == "tenant-a" and header.num_output_tokens == 2
    assert header.prompt_embeds == bytes(range(24))
    assert tokens.tolist() == [5, 6, 7, 8, 9]
