"""Control endpoints for development (`--enable-dev-endpoints`, like vLLM's
`VLLM_SERVER_DEV_MODE`): each is an engine UTILITY call, made on every live engine.

Routes (404 without the flag; behind the API key when one is set, as every route but
/health):

- `POST /reset_prefix_cache`: forget the prefix cache (409 while requests hold blocks).
- `POST /sleep?level=1|2`: abort the requests in flight (vLLM's default mode), free the KV
  cache; level 2 also moves the weights to host memory (on CPU they are there already).
  Until `POST /wake_up`, generation requests get 503. `GET /is_sleeping`: `{"is_sleeping"}`.
- `POST /pause`, `POST /resume`, `GET /is_paused`: the scheduler stops admitting and
  stepping; requests in flight (and new ones) wait, and go on at resume.
- `POST /start_profile`, `POST /stop_profile`: a torch profiler over each engine process,
  its Chrome trace written to `--profiler-dir` (400 without it).
- `POST /crash?how=segfault|abort|kill|exception`: end the API process as a native bug
  would (an invalid read: SIGSEGV; `abort()`; SIGKILL; an exception no handler catches),
  with no answer: the test hook of `trillm serve`'s supervisor (`_supervisor`), which
  restarts it. What the client sees (a closed connection) is what a real crash shows it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

from ...engine.client import AsyncLLM
from ..edge._errors import RequestError

Scope = dict[str, Any]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Handler = Callable[..., Awaitable[None]]
JSON = [(b"content-type", b"application/json")]


class DevEndpoints:
    """The control routes, and the state admission reads (`refuse_if_asleep`)."""

    def __init__(self, llm: AsyncLLM, profiler_dir: str | None) -> None:
        self.llm = llm
        self.profiler_dir = profiler_dir
        self.sleep_level = 0  # set before the engines are asked: admission refuses at once

    def routes(self) -> dict[tuple[str, str], Handler]:
        return {
            ("POST", "/reset_prefix_cache"): self._reset_prefix_cache,
            ("POST", "/sleep"): self._sleep,
            ("POST", "/wake_up"): self._wake_up,
            ("GET", "/is_sleeping"): self._is_sleeping,
            ("POST", "/pause"): self._pause,
            ("POST", "/resume"): self._resume,
            ("GET", "/is_paused"): self._is_paused,
            ("POST", "/start_profile"): self._start_profile,
            ("POST", "/stop_profile"): self._stop_profile,
            ("POST", "/crash"): self._crash,
        }

    def refuse_if_asleep(self) -> None:
        """Raise the 503 a generation request gets while the engines sleep."""
        if self.sleep_level:
            raise RequestError(
                503,
                f"the engine is asleep (POST /sleep, level {self.sleep_level}): its KV cache "
                f"is freed; POST /wake_up to serve again",
                "server_error",
            )

    # -- routes --------------------------------------------------------------------------

    async def _reset_prefix_cache(self, scope: Scope, receive: Any, send: Send, extra: Any) -> None:
        if not all(await self._on_every_engine("reset_prefix_cache")):
            raise RequestError(
                409,
                "the prefix cache is in use by requests in flight; retry when idle",
                "invalid_request_error",
            )
        await _respond(send, extra, {"reset": True})

    async def _sleep(self, scope: Scope, receive: Any, send: Send, extra: Any) -> None:
        level = _level(scope)
        before, self.sleep_level = self.sleep_level, level
        try:
            aborted = await self._on_every_engine("sleep", [level])
        except BaseException:
            self.sleep_level = before
            raise
        body = {"is_sleeping": True, "level": level, "num_aborted": sum(map(int, aborted))}
        await _respond(send, extra, body)

    async def _wake_up(self, scope: Scope, receive: Any, send: Send, extra: Any) -> None:
        await self._on_every_engine("wake_up")
        self.sleep_level = 0
        await _respond(send, extra, {"is_sleeping": False})

    async def _is_sleeping(self, scope: Scope, receive: Any, send: Send, extra: Any) -> None:
        levels = await self._on_every_engine("is_sleeping")
        await _respond(send, extra, {"is_sleeping": any(levels)})

    async def _pause(self, scope: Scope, receive: Any, send: Send, extra: Any) -> None:
        held = await self._on_every_engine("pause")
        await _respond(send, extra, {"is_paused": True, "num_requests": sum(map(int, held))})

    async def _resume(self, scope: Scope, receive: Any, send: Send, extra: Any) -> None:
        held = await self._on_every_engine("resume")
        await _respond(send, extra, {"is_paused": False, "num_requests": sum(map(int, held))})

    async def _is_paused(self, scope: Scope, receive: Any, send: Send, extra: Any) -> None:
        await _respond(send, extra, {"is_paused": any(await self._on_every_engine("is_paused"))})

    async def _start_profile(self, scope: Scope, receive: Any, send: Send, extra: Any) -> None:
        if self.profiler_dir is None:
            raise RequestError(
                400, "profiling needs a directory for the traces: start the server with "
                "--profiler-dir DIR"
            )  # fmt: skip
        traces = await self._on_every_engine("start_profile", [self.profiler_dir])
        await _respond(send, extra, {"traces": traces})

    async def _stop_profile(self, scope: Scope, receive: Any, send: Send, extra: Any) -> None:
        if self.profiler_dir is None:
            raise RequestError(400, "no profile can run: start the server with --profiler-dir DIR")
        await _respond(send, extra, {"traces": await self._on_every_engine("stop_profile")})

    async def _crash(self, scope: Scope, receive: Any, send: Send, extra: Any) -> None:
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
        how = query.get("how", ["segfault"])[-1]
        if how == "segfault":
            ctypes.string_at(0)  # reads address 0: the kernel's SIGSEGV, as in native code
        elif how == "abort":
            os.abort()
        elif how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "exception":  # raised in a system task: it ends trio.run, uncaught
            trio.lowlevel.spawn_system_task(_planted_exception)
            await trio.sleep_forever()
        raise RequestError(
            400, f"how must be segfault, abort, kill or exception, got {how!r}", param="how"
        )

    async def _on_every_engine(self, method: str, args: list[object] | None = None) -> list[Any]:
        """`method` on every live engine at once; their results by engine. A refusal (the
        engine's message) is a 400; the first failure is raised after all have answered."""
        engines = self.llm.live_engines()
        if not engines:
            raise RequestError(503, "no engine is serving (each is restarting or dead)")
        results: list[Any] = [None] * len(engines)
        failures: list[Exception] = []

        async def call(i: int, engine: int) -> None:
            try:
                results[i] = await self.llm.utility(method, engine=engine, args=args)
            except ValueError as exc:  # refused: the message says why
                where = "" if len(engines) == 1 else f"engine {engine}: "
                failures.append(RequestError(400, f"{where}{exc}"))
            except Exception as exc:  # EngineDeadError: the app's 503
                failures.append(exc)

        async with trio.open_nursery() as nursery:
            for i, engine in enumerate(engines):
                nursery.start_soon(call, i, engine)
        if failures:
            raise failures[0]
        return results


async def _planted_exception() -> None:
    raise RuntimeError("planted by POST /crash?how=exception")


def _level(scope: Scope) -> int:
    query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
    values = query.get("level", ["1"])
    if values[-1] not in ("1", "2"):
        raise RequestError(400, f"level must be 1 or 2, got {values[-1]!r}", param="level")
    return int(values[-1])


async def _respond(send: Send, extra: list[tuple[bytes, bytes]], body: object) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": JSON + extra})
    await send({"type": "http.response.body", "body": msgspec.json.encode(body)})
