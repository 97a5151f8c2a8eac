"""The frontend's LoRA adapters: names clients give as `model`, and the ids the engines know.

The frontend numbers adapters (the start-up ones 1..n, `numbered`; each load at run time the
next id, never reused, so a request sent just before an unload can never reach a later
adapter under the same id) and sends the id with each request. The engines hold the weights
and check them: a load at run time is answered only once every engine accepted it. A
restarted engine gets the adapters of the moment in its config (`modules`), so requests
resumed on it keep theirs.

Here too, what `AsyncLLM` does with them across its engines: a load on every live engine
(undone on those that took it when one refuses: `load_on_engines`), and an unload.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Awaitable, Callable, Sequence

import msgspec
import trio

from ....common.wire import LoraModule, numbered

# `AsyncLLM.utility`: (method, engine, args) -> its result; ValueError when refused.
Utility = Callable[[str, int | None, list[object] | None], Awaitable[object]]


class LoraNotFoundError(ValueError):
    """No adapter of that name is loaded."""


class LoraAdapterExistsError(ValueError):
    """An adapter of that name is loaded already: unload it first."""


class LoraAdapters:
    """Adapters by name, each with its engine id."""

    def __init__(self, modules: tuple[LoraModule, ...]) -> None:
        self.by_name = {m.name: m for m in numbered(modules)}
        self._next_id = max((m.lora_int_id for m in self.by_name.values()), default=0) + 1

    def __contains__(self, name: object) -> bool:
        return name in self.by_name

    def __len__(self) -> int:
        return len(self.by_name)

    def id_of(self, name: str | None) -> int:
        """The id of adapter `name` (None: the base model, 0).

        Raises:
            LoraNotFoundError: no adapter of that name is loaded.
        """
        if name is None:
            return 0
        module = self.by_name.get(name)
        if module is None:
            raise LoraNotFoundError(f"LoRA adapter {name!r} is not loaded")
        return module.lora_int_id

    def modules(self) -> tuple[LoraModule, ...]:
        """The adapters loaded now, with their ids (a restarted engine's `lora_modules`)."""
        return tuple(self.by_name.values())

    def new(self, name: str, path: str, base_model_name: str | None = None) -> LoraModule:
        """A module for `name` with the next id (not yet added: `add` once loaded).

        Raises:
            LoraAdapterExistsError: `name` is loaded already.
        """
        if name in self.by_name:
            raise LoraAdapterExistsError(
                f"LoRA adapter {name!r} is loaded already: unload it first"
            )
        module = LoraModule(name, path, base_model_name, self._next_id)
        self._next_id += 1
        return module

    def add(self, module: LoraModule) -> None:
        self.by_name[module.name] = module

    def reconcile(self, loaded: list[tuple[int, str]]) -> list[str]:
        """Take an engine's `Ready.loras` (id, digest): each adapter's digest, so that a
        restarted engine reads exactly the bytes checked; an adapter it does not hold (a
        restarted engine skipped it: it no longer loads) is dropped, with a line on stderr.
        Returns the names dropped."""
        digests = dict(loaded)
        dropped = []
        for name, module in list(self.by_name.items()):
            digest = digests.get(module.lora_int_id)
            if digest is None:
                del self.by_name[name]
                dropped.append(name)
            elif digest != module.digest:
                self.by_name[name] = msgspec.structs.replace(module, digest=digest)
        if dropped:
            print(f"trillm: LoRA adapters {dropped} no longer load (see the engine's reason "
                  f"above): dropped from /v1/models", file=sys.stderr, flush=True)  # fmt: skip
        return dropped

    def remove(self, name: str) -> LoraModule:
        """Forget `name` (new requests for it are refused from now on).

        Raises:
            LoraNotFoundError: no adapter of that name is loaded.
        """
        module = self.by_name.pop(name, None)
        if module is None:
            raise LoraNotFoundError(f"LoRA adapter {name!r} is not loaded")
        return module


async def load_on_engines(
    adapters: LoraAdapters,
    utility: Utility,
    engines: Sequence[int],
    name: str,
    path: str,
    base_model_name: str | None = None,
) -> LoraModule:
    """Load adapter `name` (a PEFT directory) on each of `engines`, then add it to
    `adapters` (`AsyncLLM.load_lora_adapter`).

    Raises:
        LoraAdapterExistsError: `name` is loaded already.
        ValueError: an engine refused it (LoRA off, a bad adapter); the message says why,
            and no engine keeps it.
    """
    module = adapters.new(name, path, base_model_name)
    args: list[object] = [name, path, base_model_name, module.lora_int_id]
    loaded: list[int] = []
    try:
        for engine in engines:
            digest = await utility("load_lora_adapter", engine, args)
            module = msgspec.structs.replace(module, digest=str(digest))
            loaded.append(engine)
    except BaseException:
        with trio.CancelScope(shield=True):
            for engine in loaded:
                with contextlib.suppress(Exception):
                    await utility("unload_lora_adapter", engine, [module.lora_int_id])
        raise
    adapters.add(module)
    return module


async def unload_on_engines(
    adapters: LoraAdapters, utility: Utility, engines: Sequence[int], name: str
) -> LoraModule:
    """Remove adapter `name` from `adapters`, then unload it on each of `engines`
    (`AsyncLLM.unload_lora_adapter`).

    Raises:
        LoraNotFoundError: no adapter of that name is loaded.
    """
    module = adapters.remove(name)
    for engine in engines:
        with contextlib.suppress(ValueError):  # an engine restarted without it
            await utility("unload_lora_adapter", engine, [module.lora_int_id])
    return module
