"""Runtime LoRA loads, read off the step loop: one thread per load, each with a deadline.

`load_lora_adapter` names a server path a client chose. Reading and checking it
(`trillm.gpu.read_adapter`: bounded, regular files only, finite weights, shapes of the
served model) runs on a thread of its own while the loop goes on stepping; the loop polls
the loads each iteration and answers each call once its thread is done, or once
`LOAD_TIMEOUT_S` passed (a disk that hangs: the thread is left behind, its late result
dropped). A load done hands the ranks its checked copy (`WorkerConfig.lora_cache_dir`),
so what they read inside the loop is a local file this server wrote.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ...common.wire import LoraModule

LOAD_TIMEOUT_S = 60.0
MAX_LOADS_IN_FLIGHT = 4


class LoraLoadRefusedError(ValueError):
    """Too many loads are in flight already: the caller may try again."""


@dataclass
class _Load:
    call_id: int
    module: LoraModule
    started: float
    done: threading.Event = field(default_factory=threading.Event)
    checked: LoraModule | None = None  # the module with its digest, once read and checked
    error: str = ""


@dataclass(frozen=True)
class FinishedLoad:
    """A load whose reading ended: `checked` (its module with the digest) or `error`."""

    call_id: int
    module: LoraModule
    checked: LoraModule | None
    error: str


class LoraLoads:
    """The loads in flight; `check` reads and checks a module, returning it with its digest
    (raising with the reason otherwise)."""

    def __init__(
        self, check: Callable[[LoraModule], LoraModule], *, timeout: float = LOAD_TIMEOUT_S
    ) -> None:
        self.check = check
        self.timeout = timeout
        self._loads: list[_Load] = []

    @property
    def num_pending(self) -> int:
        return len(self._loads)

    def submit(self, call_id: int, module: LoraModule) -> None:
        """Start reading `module` on a thread; `poll` gives its end.

        Raises:
            LoraLoadRefusedError: `MAX_LOADS_IN_FLIGHT` loads are being read already.
        """
        if len(self._loads) >= MAX_LOADS_IN_FLIGHT:
            raise LoraLoadRefusedError(
                f"LoRA adapter {module.name!r}: {MAX_LOADS_IN_FLIGHT} adapters are being "
                f"loaded already: try again once one is done"
            )
        load = _Load(call_id, module, time.monotonic())
        thread = threading.Thread(
            target=self._read, args=(load,), name=f"lora-load-{call_id}", daemon=True
        )
        self._loads.append(load)
        thread.start()

    def _read(self, load: _Load) -> None:
        try:
            load.checked = self.check(load.module)
        except Exception as exc:  # its caller's answer, whatever it is
            load.error = str(exc) or type(exc).__name__
        finally:
            load.done.set()

    def poll(self) -> list[FinishedLoad]:
        """The loads whose thread ended or whose deadline passed, in the order submitted."""
        if not self._loads:
            return []
        now, finished, pending = time.monotonic(), [], []
        for load in self._loads:
            if load.done.is_set():
                finished.append(FinishedLoad(load.call_id, load.module, load.checked, load.error))
            elif now - load.started > self.timeout:
                why = (
                    f"LoRA adapter {load.module.name!r}: reading its files took longer than "
                    f"{self.timeout:g} s"
                )
                finished.append(FinishedLoad(load.call_id, load.module, None, why))
            else:
                pending.append(load)
        self._loads = pending
        return finished
