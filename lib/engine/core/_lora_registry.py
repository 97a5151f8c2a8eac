"""The engine's LoRA adapters: id -> (module, digest), loaded on every rank through the executor.

The frontend knows adapters by name and sends their integer id with each request
(`AddHeader.lora_id`); the engine keeps, per id, the digest of the adapter's files, which the
prefix cache mixes into a request's block hashes, so one adapter never reads another's KV.
Loading (at start-up from `EngineConfig.lora_modules`, or at run time by the
`load_lora_adapter` utility, whose files are read and checked on a thread first) has every
rank read and check the adapter: a bad one is refused with the worker's message and changes
nothing. Unloading forgets the id for new
requests at once; the workers keep its weights until no unfinished request holds it: one
running keeps its row's adapter there, and one still waiting (or preempted) keeps it here
(`retiring`) until it ends (`retire`), so an unload never breaks a request the engine took.
"""

from __future__ import annotations

from ...common.wire import LoraModule
from ...gpu import LoraAdapterError
from .executor._executor import Executor


class LoraRegistryError(ValueError):
    """A load or unload refused: LoRA off, a name or id in use, an unknown id, a bad adapter."""


class LoraRegistry:
    """The adapters this engine serves, by id."""

    def __init__(self, executor: Executor, *, enabled: bool) -> None:
        self.executor = executor
        self.enabled = enabled
        self.modules: dict[int, LoraModule] = {}
        self.digests: dict[int, bytes] = {}
        self.retiring: set[int] = set()  # unloaded, still held by unfinished requests

    def check_new(self, module: LoraModule) -> None:
        """Raise `LoraRegistryError` if `module` could not be loaded whatever its files hold:
        LoRA is off, its id is not positive or still held, its name or id is taken."""
        if not self.enabled:
            raise LoraRegistryError(
                f"LoRA adapter {module.name!r}: LoRA is off: start the server with --enable-lora"
            )
        if module.lora_int_id < 1:
            raise LoraRegistryError(f"LoRA adapter ids start at 1, got {module.lora_int_id}")
        if module.lora_int_id in self.retiring:
            raise LoraRegistryError(
                f"LoRA adapter {module.name!r}: id {module.lora_int_id} is still held by "
                f"requests of an unloaded adapter: load it under another id"
            )
        for other in self.modules.values():
            if other.name == module.name or other.lora_int_id == module.lora_int_id:
                raise LoraRegistryError(
                    f"LoRA adapter {module.name!r} (id {module.lora_int_id}) is loaded already "
                    f"(as {other.name!r}, id {other.lora_int_id}): unload it first"
                )

    def load(self, module: LoraModule) -> int:
        """Load `module` on every rank; return its id. Its files were read and checked
        (`module.digest`): the ranks read the checked copy, and must find that digest.

        Raises:
            LoraRegistryError: as `check_new`, or a rank refused the adapter.
        """
        self.check_new(module)
        try:
            digest = self.executor.add_lora(module)
        except LoraAdapterError as exc:
            raise LoraRegistryError(str(exc)) from None
        if module.digest and digest != module.digest:  # the ranks read other bytes
            self.executor.remove_lora(module.lora_int_id)
            raise LoraRegistryError(
                f"LoRA adapter {module.name!r}: its files changed while it was loaded: load "
                f"it again"
            )
        self.modules[module.lora_int_id] = module
        self.digests[module.lora_int_id] = bytes.fromhex(digest)
        return module.lora_int_id

    def loaded(self) -> list[tuple[int, str]]:
        """(id, digest) of every adapter loaded: what `Ready` tells the frontend."""
        return [(i, d.hex()) for i, d in self.digests.items()]

    def unload(self, lora_id: int, *, held: bool) -> str:
        """Forget adapter `lora_id` for new requests; return its name. `held`: unfinished
        requests use it, so the ranks keep it until `retire` finds none.

        Raises:
            LoraRegistryError: no adapter has that id.
        """
        module = self.modules.pop(lora_id, None)
        if module is None:
            raise LoraRegistryError(f"no LoRA adapter with id {lora_id} is loaded")
        del self.digests[lora_id]
        if held:
            self.retiring.add(lora_id)
        else:
            self.executor.remove_lora(lora_id)
        return module.name

    def retire(self, held: set[int]) -> None:
        """Let every rank forget the unloaded adapters that no unfinished request (`held`:
        their ids) uses any more."""
        for lora_id in sorted(self.retiring - held):
            self.retiring.discard(lora_id)
            self.executor.remove_lora(lora_id)

    def digest_of(self, lora_id: int) -> bytes:
        """The prefix-cache identity of adapter `lora_id` (b"" for the base model, id 0).

        Raises:
            KeyError: no adapter has that id (unloaded before the request arrived).
        """
        return self.digests[lora_id] if lora_id else b""
