"""One engine process as the frontend sees it: its rings, supervisor, output pump, watchdog.

`AsyncLLM` holds one `EngineClient` per data-parallel engine. Each owns its process (spawned
from the frontend's thread, watched through a pidfd), its request ring (one writer task at a
time) and its output ring, read by its own pump task: the engines' steps are independent, so
a pump each keeps one engine's slow step from delaying another's tokens, and an engine's
death ends exactly its own pump. The pumps share the frontend's `OutputProcessor` (request
numbers are unique across engines). Death, told by a DEAD record, seen as the process exit
or declared by the watchdog, is reported once to `on_death` with the root cause.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from ....common.process import process_state
from ...protocol import _messages as P
from ...protocol._config import EngineConfig
from ...protocol._errors import RemoteError
from ...protocol._step_record import StepView
from ..outputs._output_processor import OutputProcessor
from ._connection import EngineConnection, Outgoing, ProtocolError
from ._inproc import EngineProcess, start_in_process
from ._launch import EngineStartError, exit_cause, spawn_engine
from ._watchdog import not_responding_error, wait_heartbeat_stopped


class EngineClient:
    """Engine `index` of the frontend's engines; `name` is how errors call it."""

    def __init__(
        self,
        index: int,
        name: str,
        config: EngineConfig,
        processor: OutputProcessor,
        on_death: Callable[[EngineClient, RemoteError], None],
        *,
        in_process: bool = False,
    ) -> None:
        self.index = index
        self.in_process = in_process  # a thread of this process (`_inproc`), not a process
        self.name = name
        self.config = config
        self.processor = processor
        self.on_death = on_death
        self.dead = False
        self.ready: P.Ready
        self.connection = EngineConnection()
        self._send_lock = trio.StrictFIFOLock()
        self._utility_waiters: dict[int, tuple[trio.Event, list[Any]]] = {}
        self._exit_error: RemoteError | None = None
        self._exited = trio.Event()
        self._watchdog_scope = trio.CancelScope()  # cancelled at death: the rings may close
        self._start_stalled: float | None = None  # seconds silent, when start-up stalled
        self._thread_ended = trio.Event()  # an in-process engine returned

    def named(self, error: RemoteError) -> RemoteError:
        """The cause with this engine's name in it ("engine 1", "worker rank 1 of engine 1")."""
        if self.name == "engine" or self.name in error.where:
            return error
        where = self.name if error.where == "engine" else f"{error.where} of {self.name}"
        return msgspec.structs.replace(error, where=where)

    # -- start -----------------------------------------------------------------------------

    def spawn(self, nursery: trio.Nursery) -> None:
        # `spawn_engine` forks from this thread, not a trio worker thread as
        # `trio.lowlevel.open_process` would: the engine's parent-death signal follows the
        # forking *thread*, which trio reaps when idle (the engine was SIGKILLed ~10 s in).
        config = self.config
        if self.name != "engine":  # one of several: it names its process by its index
            config = msgspec.structs.replace(config, data_parallel_rank=self.index)
        self.process: EngineProcess
        if self.in_process:
            token = trio.lowlevel.current_trio_token()
            ended = self._thread_ended

            def on_exit() -> None:  # from the engine's thread
                with contextlib.suppress(trio.RunFinishedError):
                    token.run_sync_soon(ended.set)

            self.process, self.requests, self.outputs = start_in_process(config, on_exit)
            self._pidfd: int | None = None
        else:
            self.process, self.requests, self.outputs = spawn_engine(config)
            self._pidfd = os.pidfd_open(self.process.pid)
        nursery.start_soon(self._supervise)

    async def wait_ready(self, timeout: float, watchdog_timeout: float = 0.0) -> P.Ready:
        """READY from the engine, or `EngineStartError` with its cause (named).

        A start-up that stops responding for `watchdog_timeout` (0: never) is killed, and
        that is the cause (`_watch_start`); a slow one is waited for up to `timeout`.
        """
        records: list[tuple[int, memoryview]] = []  # READY, DEAD: what the engine said
        failed: list[EngineStartError] = []  # it exited without a word
        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:
                if watchdog_timeout:
                    nursery.start_soon(self._watch_start, watchdog_timeout, nursery.cancel_scope)
                try:
                    records.append(await self._first_record())
                except EngineStartError as exc:  # raised from the body it would be grouped
                    failed.append(exc)
                finally:
                    nursery.cancel_scope.cancel()
        if failed:
            raise failed[0]
        if not records and self._start_stalled is not None:
            error = not_responding_error(self.process.pid, self._start_stalled, watchdog_timeout)
            self.process.kill()  # the supervisor reaps it; its workers die with it
            raise EngineStartError(self.named(error))
        if not records:
            raise EngineStartError(
                self.named(RemoteError("engine", "TimeoutError", f"not ready in {timeout} s"))
            )
        ready = self.connection.ready(*records[0])
        self.outputs.release()
        if isinstance(ready, RemoteError):
            raise EngineStartError(self.named(ready))
        self.ready = ready
        return self.ready

    async def _first_record(self) -> tuple[int, memoryview]:
        try:
            await self.requests.wait_attached_async()
            await self.outputs.wait_attached_async()
            return await self.outputs.peek_async()
        except trio.BrokenResourceError:
            return await self._last_words()

    async def _watch_start(self, timeout: float, scope: trio.CancelScope) -> None:
        """Cancel `scope` once the start-up stopped responding for `timeout` s.

        The engine beats the output ring's heartbeat from just after it attaches (before
        the model loads: a long load beats). Before that (the interpreter and its imports)
        it cannot beat, so there silence means a stopped process (/proc state T).
        """
        period = min(timeout / 4, 0.5)
        stopped_at: float | None = None
        while not self.outputs.peers_attached:
            await trio.sleep(period)
            now = trio.current_time()
            if not process_state(self.process.pid).startswith("T"):
                stopped_at = None
            elif stopped_at is None:
                stopped_at = now
            elif now - stopped_at >= timeout:
                self._start_stalled = now - stopped_at
                scope.cancel()
                return
        self._start_stalled = await wait_heartbeat_stopped(self.outputs, timeout)
        scope.cancel()

    def start_tasks(self, nursery: trio.Nursery, watchdog_timeout: float) -> None:
        nursery.start_soon(self._pump)
        if watchdog_timeout:
            nursery.start_soon(self._watchdog, watchdog_timeout)

    async def _last_words(self) -> tuple[int, memoryview]:
        """After the engine exited: its DEAD record if it wrote one, else its exit."""
        try:
            record = self.outputs.try_peek()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            record = None  # it wrote nothing before it died
        if record is not None:
            return record
        error = self._exit_error or RemoteError("engine", "RuntimeError", "exited")
        raise EngineStartError(self.named(error))

    # -- sending ---------------------------------------------------------------------------

    async def send_add(
        self,
        rnum: int,
        options: Any,
        max_tokens: int,
        ids: list[int],
        grammar: str = "",
        num_output_tokens: int = 0,
        *,
        cache_salt: str = "",
        prompt_embeds: bytes = b"",
        lora_id: int = 0,
    ) -> None:
        """ADD `ids` (prompt, then `num_output_tokens` already generated when resumed)."""
        record = self.connection.encode_add(
            rnum,
            options,
            max_tokens,
            ids,
            grammar,
            num_output_tokens,
            cache_salt=cache_salt,
            prompt_embeds=prompt_embeds,
            lora_id=lora_id,
        )
        await self.send(record)

    async def send(self, record: Outgoing) -> None:
        async with self._send_lock:
            view = await self._reserve(record.size)
            record.write(view)
            self.requests.commit(record.kind)

    async def send_abort(self, rnums: list[int]) -> None:
        await self.send(self.connection.encode_abort(rnums))

    async def _reserve(self, size: int) -> memoryview:
        """Room in the request ring (the caller holds `_send_lock`: one waiter at a time)."""
        return await self.requests.reserve_async(size)

    async def utility(
        self, call_id: int, method: str, args: list[object] | None = None
    ) -> tuple[bool, object]:
        """(ok, result) of an engine utility; (False, None) when the engine died meanwhile."""
        event = trio.Event()
        self._utility_waiters[call_id] = (event, [])
        try:
            await self.send(self.connection.encode_utility(call_id, method, args))
            await event.wait()
        finally:
            result = self._utility_waiters.pop(call_id)[1]
        return (bool(result[0]), result[1]) if result else (False, None)

    # -- life ------------------------------------------------------------------------------

    async def _supervise(self) -> None:
        """Wait for the engine process to exit (its pidfd; an in-process engine's thread to
        return); then every ring waiter breaks."""
        if self._pidfd is None:
            await self._thread_ended.wait()
        else:
            try:
                await trio.lowlevel.wait_readable(self._pidfd)
            except trio.ClosedResourceError:
                return  # `shutdown` closed the pidfd: nothing is left to supervise
        code = self.process.wait()  # it exited: this reaps it at once
        if code is None:
            return  # an in-process engine left running by `shutdown` (a thread is not killed)
        self._exited.set()
        self._exit_error = exit_cause(code)
        what = "thread (in process)" if self.in_process else "process"
        reason = f"the {self.name} {what} " + (
            f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        )
        for ring in (self.requests, self.outputs):
            ring.declare_peer_dead(reason)

    async def _pump(self) -> None:
        """Read every output-ring record; one pass per STEP; ends with the engine."""
        reader = self.outputs
        processor = self.processor
        while True:
            try:
                kind, payload = await reader.peek_async()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.die(self._exit_error or exit_cause(None))
                return
            try:
                record = self.connection.receive(kind, payload)
            except ProtocolError:  # an unknown kind from a newer engine: not ours to read
                reader.release()
                continue
            if isinstance(record, StepView):
                to_abort = processor.process_step(record)
                reader.release()
                if to_abort:
                    # if it died, the next peek says how
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        await self.send_abort(to_abort)
                continue
            reader.release()
            if isinstance(record, RemoteError):
                self.die(record)
                return
            if isinstance(record, P.UtilityResult):
                waiter = self._utility_waiters.get(record.call_id)
                if waiter is not None:
                    waiter[1].extend((record.ok, record.result))
                    waiter[0].set()
            elif not isinstance(record, P.Ready):
                processor.process_event(record)

    async def _watchdog(self, timeout: float) -> None:
        """Declare the engine dead, and kill it, when its heartbeat stops (`_heartbeat`)."""
        with self._watchdog_scope:
            still = await wait_heartbeat_stopped(self.outputs, timeout)
        if self._watchdog_scope.cancelled_caught:
            return
        if self.dead or self._exited.is_set():
            return  # it died or exited anyway: the supervisor tells how
        self.die(not_responding_error(self.process.pid, still, timeout))
        self.process.kill()  # the supervisor reaps it; its workers die with it

    def die(self, error: RemoteError) -> None:
        """Report the death once (named); wake every utility caller."""
        if self.dead:
            return
        self.dead = True
        self._watchdog_scope.cancel()
        for event, _ in self._utility_waiters.values():
            event.set()
        self.on_death(self, self.named(error))

    async def shutdown(self, timeout: float) -> None:
        """Drain the engine (bounded), then make sure it is gone and the rings are closed."""
        with trio.CancelScope(shield=True):
            if not self.dead and self.process.poll() is None:
                record = self.connection.encode_shutdown("drain", timeout)
                view = self.requests.try_reserve(record.size)
                if view is not None:
                    record.write(view)
                    self.requests.commit(record.kind)
            with trio.move_on_after(timeout + 5):
                await self._exited.wait()
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
            self._thread_ended.set()  # an in-process engine: its supervisor stops waiting
            if self._pidfd is not None:
                trio.lowlevel.notify_closing(self._pidfd)
                os.close(self._pidfd)
            self.die(RemoteError("engine", "EngineShutdown", "the engine was shut down"))
            self.requests.close()
            self.outputs.close()
