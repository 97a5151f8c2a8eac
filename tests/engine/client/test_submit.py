"""`open_request`: each child opened before its ADD, and every unfinished one forgotten and
aborted on exit, however the block ends (a fake engine and pool: no processes)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio

from trillm.engine.client._errors import EngineDeadError
from trillm.engine.client._submit import open_request
from trillm.engine.client.outputs._output_processor import OutputProcessor, RequestState
from trillm.engine.client.outputs._outputs import Mailbox
from trillm.engine.protocol import RemoteError


class Engine:
    """Records what it is sent, and whether each ADD's request was open by then."""

    def __init__(self, processor: OutputProcessor, *, broken: bool = False) -> None:
        self.index, self.dead, self.broken = 0, False, broken
        self.processor = processor
        self.sent: list[tuple[str, Any]] = []

    async def send_add(
        self,
        rnum: int,
        options: Any,
        max_tokens: int,
        ids: list[int],
        *args: Any,
        lora_id: int,
        **kw: Any,
    ) -> None:
        await trio.lowlevel.checkpoint()
        if self.broken:
            raise trio.BrokenResourceError
        self.sent.append(("add", (rnum, rnum in self.processor, options, max_tokens, lora_id)))

    async def send_abort(self, rnums: list[int]) -> None:
        await trio.lowlevel.checkpoint()
        self.sent.append(("abort", rnums))


def pool_and_engine(*, broken: bool = False) -> tuple[Any, Engine]:
    processor = OutputProcessor()
    errors: dict[int, EngineDeadError] = {}

    def check_engine(client: Engine) -> None:
        if client.index in errors:
            raise errors[client.index]

    router = SimpleNamespace(loads=[0])
    pool = SimpleNamespace(processor=processor, router=router, errors=errors)
    pool.check_engine = check_engine
    return pool, Engine(processor, broken=broken)


def children(n: int) -> list[RequestState]:
    mailbox = Mailbox()
    return [
        RequestState(
            rnum=r,
            index=r - 1,
            mailbox=mailbox,
            detokenizer=None,  # open_request never reads it
            stop=None,
            num_prompt_tokens=1,
            logprobs=None,
            prompt_token_ids=[7],
            lora_id=3,
        )
        for r in range(1, n + 1)
    ]


def fill(state: RequestState) -> None:
    state.options, state.max_tokens = f"options {state.index}", 5


async def test_each_child_is_open_before_its_add_and_aborted_when_left() -> None:
    pool, engine = pool_and_engine()
    states = children(2)
    async with open_request(pool, engine, states, fill):  # type: ignore[arg-type]
        assert pool.router.loads == [2] and all(s.on_engine for s in states)
        assert engine.sent == [
            ("add", (1, True, "options 0", 5, 3)),
            ("add", (2, True, "options 1", 5, 3)),
        ]
    assert engine.sent[2:] == [("abort", [1, 2])]
    assert not len(pool.processor) and pool.router.loads == [0]


async def test_only_the_unfinished_are_aborted_and_none_when_all_finished() -> None:
    pool, engine = pool_and_engine()
    states = children(2)
    async with open_request(pool, engine, states, fill):  # type: ignore[arg-type]
        states[0].finished = True
    assert engine.sent[2:] == [("abort", [2])]
    async with open_request(pool, engine, states, fill):  # type: ignore[arg-type]
        states[1].finished = True
    assert engine.sent[-1][0] == "add"


async def test_a_cancelled_block_still_aborts_and_a_dead_engine_is_not_told() -> None:
    pool, engine = pool_and_engine()
    with trio.CancelScope() as scope:
        async with open_request(pool, engine, children(1), fill):  # type: ignore[arg-type]
            scope.cancel()
            await trio.sleep_forever()
    assert engine.sent[-1] == ("abort", [1])
    engine.dead = True
    with pytest.raises(KeyError):
        async with open_request(pool, engine, children(1), fill):  # type: ignore[arg-type]
            raise KeyError
    assert engine.sent[-1][0] == "add" and not len(pool.processor)


async def test_a_broken_ring_raises_why_the_engine_died_and_a_bad_fill_aborts() -> None:
    pool, engine = pool_and_engine(broken=True)
    pool.errors[0] = EngineDeadError(RemoteError("engine", "RuntimeError", "boom"))
    with pytest.raises(EngineDeadError, match="the engine died") as died:
        async with open_request(pool, engine, children(1), fill):  # type: ignore[arg-type]
            pytest.fail("no stream without its ADD")
    assert died.value is pool.errors[0]
    assert engine.sent == [("abort", [1])] and not len(pool.processor)

    def bad(state: RequestState) -> None:
        raise ValueError("bad options")

    pool, engine = pool_and_engine()
    with pytest.raises(ValueError, match="bad options"):
        async with open_request(pool, engine, children(2), bad):  # type: ignore[arg-type]
            pytest.fail("no stream without its ADD")
    assert engine.sent == [("abort", [1, 2])] and pool.router.loads == [0]
