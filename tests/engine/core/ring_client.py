"""A small synchronous stand-in for the frontend, to test the engine process through its rings."""

from __future__ import annotations

import time
from collections import defaultdict

from trillm.engine.client.engines._connection import EngineConnection, Outgoing
from trillm.engine.client.engines._launch import spawn_engine, wait_ready
from trillm.engine.protocol import _messages as P
from trillm.engine.protocol._config import EngineConfig
from trillm.engine.protocol._errors import RemoteError
from trillm.engine.protocol._step_record import StepView
from trillm.gpu import SamplingOptions
from trillm.transport_shm import BusyError

GREEDY = SamplingOptions(temperature=0.0, ignore_eos=True)


class EngineClient:
    def __init__(self, config: EngineConfig, *, start_timeout: float = 120.0) -> None:
        self.process, self.requests, self.outputs = spawn_engine(config)
        self.connection = EngineConnection()
        try:
            self.ready = wait_ready(self.process, self.requests, self.outputs, start_timeout)
        except BaseException:
            self.close()
            raise
        self.tokens: dict[int, list[int]] = defaultdict(list)
        self.finish: dict[int, int] = {}
        self.cached: dict[int, int] = {}
        self.events: list[P.Event] = []
        self.dead: RemoteError | None = None
        self.dead_at: float | None = None
        self.steps = 0
        self.last_step = -1  # the last STEP record's step number

    def add(
        self, rnum: int, prompt: list[int], max_tokens: int, options: SamplingOptions = GREEDY
    ) -> None:
        self.send(self.connection.encode_add(rnum, options, max_tokens, prompt))

    def abort(self, rnums: list[int]) -> None:
        self.send(self.connection.encode_abort(rnums))

    def utility(self, call_id: int, method: str, *args: object) -> None:
        self.send(self.connection.encode_utility(call_id, method, list(args)))

    def shutdown(self, mode: str, timeout: float = 30.0) -> None:
        self.send(self.connection.encode_shutdown(mode, timeout))

    def send(self, record: Outgoing) -> None:
        record.write(self.requests.reserve(record.size, timeout=10))
        self.requests.commit(record.kind)

    def pump(self, timeout: float) -> bool:
        """Handle one record; False once the engine is gone (DEAD read or the process ended)."""
        try:
            kind, payload = self.outputs.peek(timeout=timeout)
        except BusyError:
            if self.process.poll() is not None:
                self.outputs.declare_peer_dead(f"engine exited with {self.process.returncode}")
            return self.process.poll() is None or self.outputs.try_peek() is not None
        except Exception:  # broken: the engine closed or was declared dead, all read
            return False
        try:
            message = self.connection.receive(kind, payload)
            if isinstance(message, StepView):
                self._step(message)
            elif isinstance(message, RemoteError):
                self.dead, self.dead_at = message, time.monotonic()
                return False
            elif not isinstance(message, P.Ready):
                self.events.append(message)
        finally:
            self.outputs.release()
        return True

    def _step(self, view: StepView) -> None:
        self.steps += 1
        self.last_step = view.step
        offsets = view.tok_offsets.tolist()
        tokens = view.tokens.tolist()
        cached = None if view.num_cached_tokens is None else view.num_cached_tokens.tolist()
        for i, rnum in enumerate(view.rnums.tolist()):
            self.tokens[rnum].extend(tokens[offsets[i] : offsets[i + 1]])
            if cached is not None and rnum not in self.cached:
                self.cached[rnum] = cached[i]
            if view.finish[i]:
                self.finish[rnum] = int(view.finish[i])

    def run_until(self, done: object, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise TimeoutError("the engine did not get there in time")
            if not self.pump(0.1) and not done():  # type: ignore[operator]
                raise AssertionError(f"the engine died: {self.dead}")

    def wait_exit(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            self.pump(0.05)
        return self.process.wait(timeout=max(0.1, deadline - time.monotonic()))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        self.requests.close()
        self.outputs.close()
