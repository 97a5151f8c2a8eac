"""The frontend's engines: their clients, the router, and each one's state, death and restart.

One object says whether engine `i` serves: `EnginePool.state[i]` is SERVING, RESTARTING or
DEAD, and `errors[i]` says why it is not serving. An engine's death (a DEAD record, the
process's exit, or the watchdog: `_engine_client`) reaches `_on_death` once. Within
`max_engine_restarts` the engine is started again and its open requests resume on it
(`_resume`: prompt + tokens so far; a poison request is found and fails alone); past the
bound its open requests fail in one synchronous pass with an `EngineDeadError` naming the
root cause, and the others keep serving. Once no engine serves or is coming back, the pool
is dead: every later call raises that error at once.
"""

from __future__ import annotations

import contextlib
import enum
import sys
import time
from collections.abc import Callable, Sequence

import msgspec
import trio

from ....common.wire import LoraModule
from ...protocol import _messages as P
from ...protocol._errors import RemoteError
from .._config import LLMConfig
from .._errors import (
    DataParallelRankError,
    EngineDeadError,
    EngineRestartingError,
    PinnedEngineDeadError,
)
from ..outputs._output_processor import OutputProcessor
from ._engine_client import EngineClient
from ._launch import EngineStartError
from ._restarts import RestartPolicy
from ._resume import judge, poison_error, release_quarantined, resend
from ._router import EngineRouter


class EngineState(enum.Enum):
    SERVING = "serving"
    RESTARTING = "restarting"  # dead, being started again: no request reaches it meanwhile
    DEAD = "dead"  # for good (past the restart bound, or it died while starting)


class EnginePool:
    """The engines of one `AsyncLLM`, indexable (`pool[i]`, `len(pool)`)."""

    def __init__(self, config: LLMConfig, processor: OutputProcessor) -> None:
        self.config = config
        self.processor = processor
        self.clients: list[EngineClient] = []
        self.state: list[EngineState] = []
        self.errors: dict[int, EngineDeadError] = {}  # engine index -> why it is not serving
        self.restarts = RestartPolicy(config.max_engine_restarts, config.engine_restart_window)
        self.router = EngineRouter(config.data_parallel_size, config.engine.worker.block_size)
        self.error: EngineDeadError | None = None  # set once no engine serves or comes back
        self._died = trio.Event()
        self._back = trio.Event()  # set (and renewed) when a restarted engine is READY
        self._shutting_down = False
        # The LoRA adapters loaded now (`AsyncLLM.loras.modules`): a restarted engine starts
        # with them, so requests resumed on it keep their adapter.
        self.lora_modules: Callable[[], tuple[LoraModule, ...]] | None = None
        # Told each engine's READY (`AsyncLLM.loras.reconcile`): the adapters it holds.
        self.on_ready: Callable[[P.Ready], None] | None = None

    def __len__(self) -> int:
        return len(self.clients)

    def __getitem__(self, index: int) -> EngineClient:
        return self.clients[index]

    # -- start ------------------------------------------------------------------------------

    def spawn(self, nursery: trio.Nursery) -> None:
        """Start every engine process (its READY is awaited by `wait_ready`)."""
        self._nursery = nursery
        configs = self.config.engine_configs()
        for i, config in enumerate(configs):
            name = "engine" if len(configs) == 1 else f"engine {i}"
            client = EngineClient(
                i, name, config, self.processor, self._on_death, in_process=self.config.in_process
            )
            self.clients.append(client)
            self.state.append(EngineState.SERVING)
            client.spawn(nursery)

    async def wait_ready(self) -> None:
        """Every engine READY within `start_timeout`, then its tasks (pump, watchdog) run.

        Raises:
            EngineStartError: an engine failed before READY, naming why.
        """
        deadline = trio.current_time() + self.config.start_timeout
        for client in self.clients:
            remaining = max(0.0, deadline - trio.current_time())
            ready = await client.wait_ready(remaining, self.watchdog_timeout)
            if self.on_ready is not None:
                self.on_ready(ready)

    def start_tasks(self) -> None:
        for client in self.clients:
            client.start_tasks(self._nursery, self.watchdog_timeout)

    @property
    def watchdog_timeout(self) -> float:
        """0 (off) for an in-process engine: a thread cannot be killed, nor stopped alone."""
        return 0.0 if self.config.in_process else self.config.watchdog_timeout

    # -- which engine -------------------------------------------------------------------------

    def live(self) -> list[int]:
        """Indexes of the engines serving (not dead, not restarting)."""
        return [i for i, state in enumerate(self.state) if state is EngineState.SERVING]

    @property
    def restarting(self) -> bool:
        return EngineState.RESTARTING in self.state

    def check_alive(self) -> None:
        """Raise the pool's `EngineDeadError` once no engine serves or comes back."""
        if self.error is not None:
            raise self.error

    def check_rank(self, rank: int | None) -> None:
        """Check a request's `data_parallel_rank` (None: the router chooses).

        Raises:
            DataParallelRankError: `rank` is not in [0, data_parallel_size).
        """
        size = len(self)
        if rank is not None and not 0 <= rank < size:
            raise DataParallelRankError(
                f"data_parallel_rank must be in [0, {size}) (the data-parallel size), got {rank}"
            )

    def check_engine(self, client: EngineClient) -> None:
        """Raise why engine `client` is not serving, if it is not."""
        if client.index in self.errors:
            raise self.errors[client.index]

    async def wait_dead(self) -> EngineDeadError:
        await self._died.wait()
        assert self.error is not None
        return self.error

    async def choose(
        self, token_ids: Sequence[int], cache_salt: str = "", rank: int | None = None
    ) -> EngineClient:
        """The engine for a prompt of a cache salt's tenant (`_router`), or engine `rank`
        when the caller pinned one. While every engine (or the pinned one) restarts, wait for
        it (at most `engine_restart_wait`) instead of failing.

        Raises:
            EngineRestartingError: none came back in time (the restart goes on).
            PinnedEngineDeadError: engine `rank` is dead for good (others may serve).
            EngineDeadError: none is serving or coming back.
        """
        self.check_alive()
        if rank is not None:
            return await self._pinned(token_ids, cache_salt, rank)
        wait = self.config.engine_restart_wait
        with trio.move_on_after(wait):
            while not self.live():
                await self._back.wait()
                self.check_alive()
        self.check_alive()
        live = self.live()
        if not live:
            raise EngineRestartingError(next(iter(self.errors.values())).error, wait)
        return self.clients[self.router.choose(token_ids, live, cache_salt)]

    async def _pinned(self, token_ids: Sequence[int], cache_salt: str, rank: int) -> EngineClient:
        wait = self.config.engine_restart_wait
        with trio.move_on_after(wait):
            while self.state[rank] is EngineState.RESTARTING:
                await self._back.wait()
        self.check_alive()
        if self.state[rank] is EngineState.DEAD:
            raise PinnedEngineDeadError(rank, self.errors[rank])
        if self.state[rank] is EngineState.RESTARTING:
            raise EngineRestartingError(self.errors[rank].error, wait)
        self.router.remember(token_ids, rank, cache_salt)
        return self.clients[rank]

    def serving(self, index: int | None) -> EngineClient:
        """Engine `index` if it serves (else why not), or the first serving one."""
        self.check_alive()
        if index is not None:
            self.check_engine(self.clients[index])
            return self.clients[index]
        live = self.live()
        if not live:  # every engine is restarting
            raise next(iter(self.errors.values()))
        return self.clients[live[0]]

    # -- death and restart --------------------------------------------------------------------

    def _on_death(self, client: EngineClient, error: RemoteError) -> None:
        """Start the engine again if the bounds allow, its open requests paused to resume on
        it; otherwise fail them (one pass). Once no engine is left or coming back, all fail."""
        dead = EngineDeadError(error)
        self.errors[client.index] = dead
        self.router.engine_died(client.index)
        if not self._shutting_down and self.restarts.allow():
            held = self._suspend(client.index, dead)
            print(
                f"trillm: {dead}; starting it again (restart {self.restarts.total}, at most "
                f"{self.restarts.max_restarts} within {self.restarts.window:g} s); {held} "
                f"open requests resume on it",
                file=sys.stderr,
                flush=True,
            )
            self.state[client.index] = EngineState.RESTARTING
            self._nursery.start_soon(self._restart, client)
            return
        self.state[client.index] = EngineState.DEAD
        self.processor.fail(dead, self.processor.of_engine(client.index))
        live = self.live()
        if self._shutting_down:
            pass
        elif live:
            print(f"trillm: {dead}; engines {live} keep serving", file=sys.stderr, flush=True)
        elif self.restarts.max_restarts:
            print(f"trillm: {dead}; not restarted: {self.restarts.describe_refusal()}",
                  file=sys.stderr, flush=True)  # fmt: skip
        self._final_death(dead)

    def _suspend(self, engine: int, dead: EngineDeadError) -> int:
        """Keep `engine`'s open requests for its restart, but fail a poison request
        (`_resume.judge`: the one request at the last two deaths, or a quarantined one that
        killed it alone)."""
        held = self.processor.of_engine(engine)
        judgement = judge(held, dead.error.step_rnums)
        self.processor.fail(lambda state: poison_error(dead, state), judgement.poison)
        for state in judgement.poison:
            print(f"trillm: request {state.rnum} was in the engine's batch at {state.deaths} "
                  f"deaths in a row: it fails with the cause, not resumed again",
                  file=sys.stderr, flush=True)  # fmt: skip
        if judgement.quarantined:
            print(f"trillm: {len(judgement.quarantined)} requests shared the engine's batch at "
                  f"its last deaths: each resumes alone among them (quarantine), to find the "
                  f"cause", file=sys.stderr, flush=True)  # fmt: skip
        return len(held) - len(judgement.poison)

    def _final_death(self, dead: EngineDeadError) -> None:
        if not self.live() and not self.restarting and self.error is None:
            self.error = dead
            self._died.set()
            self._back.set()  # waiters see the death

    async def _restart(self, old: EngineClient) -> None:
        """Release the dead engine (process reaped, rings closed), start a new one, resume
        its requests (`_resume.resend`; the quarantined ones one at a time), serve."""
        await old.shutdown(0)
        index = old.index
        config = old.config
        if self.lora_modules is not None:
            config = msgspec.structs.replace(config, lora_modules=self.lora_modules())
        client = EngineClient(
            index, old.name, config, self.processor, self._on_death, in_process=old.in_process
        )
        self.clients[index] = client
        started = time.monotonic()
        try:
            client.spawn(self._nursery)
            ready = await client.wait_ready(self.config.start_timeout, self.watchdog_timeout)
            if self.on_ready is not None:  # it may have skipped adapters that no longer load
                self.on_ready(ready)
        except EngineStartError as exc:  # dying while starting: never again, in a loop
            print(f"trillm: the restarted {client.name} failed to start: {exc}", file=sys.stderr,
                  flush=True)  # fmt: skip
            client.dead = True
            self.state[index] = EngineState.DEAD
            self.errors[index] = EngineDeadError(exc.error)
            self.processor.fail(self.errors[index], self.processor.of_engine(index))
            self._final_death(self.errors[index])
            return
        client.start_tasks(self._nursery, self.watchdog_timeout)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            for state in self.processor.of_engine(index):
                if not state.quarantined:
                    await resend(client, state)
            self._nursery.start_soon(release_quarantined, client, self.processor)
        if client.dead:  # it died while its requests were resent: that death is handled
            return
        self.errors.pop(index, None)
        self.state[index] = EngineState.SERVING
        print(
            f"trillm: {client.name} restarted in {time.monotonic() - started:.1f} s; serving",
            file=sys.stderr,
            flush=True,
        )
        back, self._back = self._back, trio.Event()
        back.set()

    async def shutdown(self) -> None:
        """Drain every engine (bounded, together), then make sure they are gone."""
        self._shutting_down = True
        self.state = [EngineState.DEAD if s is EngineState.RESTARTING else s for s in self.state]
        async with trio.open_nursery() as nursery:
            for client in self.clients:
                if hasattr(client, "process"):
                    nursery.start_soon(client.shutdown, self.config.shutdown_timeout)
