"""The engine's control calls (UTILITY records), and the rule that no call can end it.

`pause` stops scheduling and stepping (requests stay queued or running and go on at
`resume`; ADD and ABORT are still read). `sleep` aborts the requests in flight (as vLLM's
default mode), forgets the prefix cache (its blocks' contents are about to go) and has the
executor free the KV cache (level 2: the weights go to host memory too); asleep, nothing
steps until `wake_up`. `start_profile` / `stop_profile` wrap this process in a torch
profiler and write a Chrome trace. `load_lora_adapter` reads its files on a thread
(`_lora_loads`) and is answered once they are read and checked; the loop steps meanwhile.

The rule: whatever a control call raises (bad arguments of any type, a path the filesystem
refuses, a failure of the code below) is that call's answer, ok=False with the cause, and
the engine serves on. Only a rank's death (`WorkerDiedError`) or the step loop's own faults
end the engine.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import msgspec

from ...common.wire import LoraModule
from ...gpu import read_adapter
from ..protocol import _messages as P
from ._errors import WorkerDiedError
from ._lora_loads import LoraLoadRefusedError, LoraLoads
from ._lora_registry import LoraRegistryError

if TYPE_CHECKING:
    from ._engine_core import EngineCore

SLEEP_LEVELS = (1, 2)
_LATER: Final = object()  # a call answered later (`answer`), when its work is done


class UtilityError(ValueError):
    """A control call refused (bad arguments, wrong state); its message goes to the caller."""


class Controls:
    """The control calls of one engine (`engine`: its scheduler, executor and adapters)."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.profiler: Any = None  # a running torch.profiler.profile
        self.profile_path = ""
        self.lora_loads = LoraLoads(self.check_lora)

    def call(self, call: P.UtilityCall) -> None:
        """Answer `call`, now or (a LoRA load) once its files are read; never raise but for a
        rank's death."""
        ok, result = _guarded(call.method, self._dispatch, call.call_id, call.method, call.args)
        if result is not _LATER:
            self.engine.answer(P.UtilityResult(call.call_id, ok, result))

    def _dispatch(self, call_id: int, method: str, args: list[object]) -> object:
        engine = self.engine
        if method not in P.UTILITY_METHODS:
            raise UtilityError(f"unknown utility method {method!r}")
        if method == "reset_prefix_cache":
            return engine.scheduler.reset_prefix_cache()
        if method == "stats":
            return msgspec.to_builtins(engine.scheduler.statistics())
        if method == "sleep":
            return self._sleep(args[0] if args else 1)
        if method == "wake_up":
            return self._wake_up()
        if method == "is_sleeping":
            return engine.sleep_level
        if method in ("pause", "resume"):
            engine.is_paused = method == "pause"
            return len(engine.scheduler.unfinished_rnums())
        if method == "is_paused":
            return engine.is_paused
        if method == "start_profile":
            return self._start_profile(args[0] if args else "")
        if method == "stop_profile":
            return self._stop_profile()
        if method == "load_lora_adapter":
            return self._load_lora(call_id, args)
        if method == "unload_lora_adapter":
            return self._unload_lora(args)
        return "pong"

    # -- LoRA adapters ---------------------------------------------------------------------

    def _load_lora(self, call_id: int, args: list[object]) -> object:
        """args [name, path, base_model_name, id]; answered later with the adapter's digest."""
        if len(args) != 4 or not all(isinstance(a, str) for a in args[:2]):
            raise UtilityError(f"load_lora_adapter takes [name, path, base, id], got {args!r}")
        name, path, base, lora_id = args
        if not isinstance(lora_id, int) or isinstance(lora_id, bool):
            raise UtilityError(f"load_lora_adapter: the id must be an integer, got {lora_id!r}")
        module = LoraModule(str(name), str(path), None if base is None else str(base), lora_id)
        try:
            self.engine.loras.check_new(module)
            self.lora_loads.submit(call_id, module)
        except (LoraRegistryError, LoraLoadRefusedError) as exc:
            raise UtilityError(str(exc)) from None
        return _LATER

    def check_lora(self, module: LoraModule) -> LoraModule:
        """`module` with its digest, its files read and checked (on a load's thread)."""
        executor, worker = self.engine.executor, self.engine.config.worker
        if not executor.reads_adapters:  # the null executor: no model to check against
            return msgspec.structs.replace(module, digest=executor.add_lora(module))
        adapter = read_adapter(
            module,
            executor.model_config,
            worker.max_lora_rank,
            cache_dir=worker.lora_cache_dir,
        )
        return adapter.module

    def admit_loaded_loras(self) -> None:
        """Hand the loads whose files were read and checked to the ranks; answer each."""
        for load in self.lora_loads.poll():
            ok, result = False, load.error  # type: tuple[bool, object]
            if load.checked is not None:
                ok, result = _guarded("load_lora_adapter", self._load_checked, load.checked)
            self.engine.answer(P.UtilityResult(load.call_id, ok, result))

    def _load_checked(self, module: LoraModule) -> str:
        try:
            self.engine.loras.load(module)
        except LoraRegistryError as exc:
            raise UtilityError(str(exc)) from None
        return module.digest

    def _unload_lora(self, args: list[object]) -> str:
        """args [id] -> the adapter's name."""
        lora_id = args[0] if len(args) == 1 else None
        if not isinstance(lora_id, int) or isinstance(lora_id, bool):
            raise UtilityError(f"unload_lora_adapter takes [id], got {args!r}")
        try:
            return self.engine.loras.unload(lora_id, held=lora_id in self.engine.held_loras())
        except LoraRegistryError as exc:
            raise UtilityError(str(exc)) from None

    # -- sleep -----------------------------------------------------------------------------

    def _sleep(self, level: object) -> int:
        """Abort what is in flight, forget the prefix cache, free the KV cache (and at level
        2 move the weights to host memory); return how many requests were aborted."""
        engine = self.engine
        if not isinstance(level, int) or isinstance(level, bool) or level not in SLEEP_LEVELS:
            raise UtilityError(f"sleep level must be 1 or 2, got {level!r}")
        if engine.sleep_level:
            if level == engine.sleep_level:
                return 0
            raise UtilityError(
                f"the engine is asleep at level {engine.sleep_level}: wake it up before "
                f"sleeping at level {level}"
            )
        aborted = engine.scheduler.unfinished_rnums()
        engine.abort(aborted)
        engine.finish_pending()  # its rows dropped, its aborts reported: then the KV can go
        engine.scheduler.reset_prefix_cache()  # no block is held now, so this cannot refuse
        engine.executor.sleep(level)
        engine.sleep_level = level
        return len(aborted)

    def _wake_up(self) -> int:
        """Reallocate the KV cache (and bring the weights back); return the level left."""
        engine = self.engine
        level = engine.sleep_level
        if level:
            engine.executor.wake_up()
            engine.sleep_level = 0
        return level

    # -- profile ---------------------------------------------------------------------------

    def _start_profile(self, directory: object) -> str:
        """Start a torch profiler over this process; return the trace file it will write."""
        if not isinstance(directory, str) or not directory:
            raise UtilityError("start_profile needs a directory for the trace (--profiler-dir)")
        if self.profiler is not None:
            raise UtilityError(f"a profile is running already (to {self.profile_path})")
        import torch.profiler

        try:
            os.makedirs(directory, exist_ok=True)
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
            raise UtilityError(
                f"cannot create the profiler directory {directory[:200]!r}: {exc}"
            ) from None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # the model is here
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        rank = self.engine.config.data_parallel_rank
        engine = "engine" if rank is None else f"engine_{rank}"
        name = f"trillm-{engine}-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}.pt.trace.json"
        profiler = torch.profiler.profile(activities=activities)
        profiler.start()
        self.profiler, self.profile_path = profiler, os.path.join(directory, name)
        return self.profile_path

    def _stop_profile(self) -> str:
        """Stop the profiler and write its Chrome trace; return the file's path."""
        profiler, path = self.profiler, self.profile_path
        if profiler is None:
            raise UtilityError("no profile is running: start one first (POST /start_profile)")
        self.profiler = None
        profiler.stop()
        profiler.export_chrome_trace(path)
        return path


def _guarded(method: str, run: Callable[..., object], *args: Any) -> tuple[bool, object]:
    """(True, what `run` returns), or (False, why it raised): a refusal's message, or the
    type and message of anything else it raised (its traceback on stderr). Only a rank's
    death goes through: that is the engine's own, whatever the call was."""
    try:
        return True, run(*args)
    except UtilityError as exc:
        return False, str(exc)
    except WorkerDiedError:
        raise
    except Exception as exc:  # the call's failure, never the engine's
        print(f"trillm engine: control call {method!r} failed:", file=sys.stderr)
        traceback.print_exc()
        return False, f"{method} failed: {type(exc).__name__}: {exc}"
