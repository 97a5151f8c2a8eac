"""The runner's adapters: which are known, which are in host memory, which sit in a slot.

Three levels, as vLLM's LRU managers:

- known (`add`, `remove`): id -> `LoraModule`, told by the engine on every rank; `add` reads
  and checks the adapter at once, so a bad one is refused before any request names it.
- host memory: up to `--max-cpu-loras` read adapters, least recently used dropped (an
  adapter dropped is read again when a request needs it: from the checked copy of its files,
  `_lora_files`, never from the user's path, and only bytes with its digest).
- device slots: `--max-loras` fixed slots (`_lora_slots`). A step's adapters are put in slots
  before its forward (`prepare`); a free slot first, else the least recently used slot whose
  adapter no live request uses. The scheduler admits at most `--max-loras` distinct adapters
  among running requests, so a step always finds its slots.

Requests keep their adapter through `remove`: an adapter unloaded while requests use it stays
in its slot until they end (the engine refuses new requests for it).

A read again inside a step that fails (the checked copy gone, the disk failing) fails the
requests of that adapter alone: their rows run without it this step, `take_failures` names
them, and the engine ends them with the reason (`RunnerOutput.failed`). At TP > 1 rank 0's
failures are the ones reported: every rank reads the same checked copy, so they fail together.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

import numpy as np
import torch

from ...common.wire import LoraModule
from ..layers._layers import ColumnParallelLinear, RowParallelLinear
from ..layers._parallel import TensorParallel
from ..models._model_config import ModelConfig
from ..models.llama import LlamaForCausalLM, LlamaMLP
from ._lora_files import LoraAdapterError
from ._lora_slots import LoraBatch, LoraLinear
from ._lora_weights import LoraAdapter, read_adapter

# base linear -> the adapter targets of its merged parts
_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


class LoraSlotsFullError(RuntimeError):
    """A step holds more adapters than free slots (the scheduler's `max_loras` bound broke)."""


class LoraManager:
    """Adapters known, in host memory and in device slots, for one rank's model."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        tp: TensorParallel,
        *,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        max_rows: int,
        dtype: torch.dtype,
        device: torch.device,
        cache_dir: str = "",
    ) -> None:
        self.model_config = model_config
        self.cache_dir = cache_dir
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self.batch = LoraBatch()
        self.known: dict[int, LoraModule] = {}
        self.unloaded: set[int] = set()  # removed while requests still used them
        self.host: OrderedDict[int, LoraAdapter] = OrderedDict()
        self.slot_ids = [0] * max_loras  # slot -> adapter id (0: free)
        self.slot_of: dict[int, int] = {}
        self._slot_clock = [0] * max_loras  # the step each slot was last used
        self._clock = 0
        self.row_ids = np.zeros(max_rows, np.int64)  # input-batch row -> adapter id (0: base)
        self.live: Counter[int] = Counter()  # adapter id -> rows using it
        self.linears: list[tuple[int, str, LoraLinear]] = []  # (layer, base linear name, ...)
        self.num_loads = 0  # copies into a slot
        self._failed: dict[int, str] = {}  # adapter id -> why its read failed in this step
        for layer in model.decoder_layers():
            attn = layer.self_attn
            modules = {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj}
            if isinstance(layer.mlp, LlamaMLP):  # experts take no adapter
                modules |= {
                    "gate_up_proj": layer.mlp.gate_up_proj,
                    "down_proj": layer.mlp.down_proj,
                }
            for name, base in modules.items():
                column = isinstance(base, ColumnParallelLinear)
                if isinstance(base, ColumnParallelLinear):
                    parts, in_local = list(base.shard_sizes), model_config.hidden_size
                elif isinstance(base, RowParallelLinear):
                    parts, in_local = [model_config.hidden_size], base.shard
                else:
                    continue
                base.lora = LoraLinear(
                    column=column,
                    parts=parts,
                    in_local=in_local,
                    num_slots=max_loras,
                    max_rank=max_rank,
                    tp_rank=tp.rank,
                    batch=self.batch,
                    dtype=dtype,
                    device=device,
                )
                self.linears.append((layer.layer, name, base.lora))

    # -- known adapters ----------------------------------------------------------------------

    def add(self, module: LoraModule) -> str:
        """Know `module` (its id), reading and checking it now; return its digest.

        Raises:
            LoraAdapterError: it cannot be served (the message names it and why).
        """
        adapter = read_adapter(module, self.model_config, self.max_rank, cache_dir=self.cache_dir)
        lora_id = module.lora_int_id
        if lora_id in self.slot_of:  # the id is reused for new weights: the old slot is stale
            self._free_slot(self.slot_of[lora_id])
        self.known[lora_id] = adapter.module  # with its digest: what a read again must find
        self.unloaded.discard(lora_id)
        self._keep_in_host(adapter)
        return adapter.digest

    def remove(self, lora_id: int) -> None:
        """Forget adapter `lora_id` for new requests; those running keep it until they end."""
        if lora_id not in self.known:
            return
        if self.live[lora_id]:
            self.unloaded.add(lora_id)
            return
        self._drop(lora_id)

    def _drop(self, lora_id: int) -> None:
        self.known.pop(lora_id, None)
        self.unloaded.discard(lora_id)
        self.host.pop(lora_id, None)
        if lora_id in self.slot_of:
            self._free_slot(self.slot_of[lora_id])

    def _keep_in_host(self, adapter: LoraAdapter) -> None:
        lora_id = adapter.module.lora_int_id
        self.host[lora_id] = adapter
        self.host.move_to_end(lora_id)
        while len(self.host) > self.max_cpu_loras:
            evictable = [i for i in self.host if i not in self.slot_of and i != lora_id]
            if not evictable:
                break
            del self.host[evictable[0]]

    # -- rows ----------------------------------------------------------------------------------

    def add_row(self, row: int, lora_id: int) -> None:
        """Input-batch row `row` now holds a request of adapter `lora_id` (0: the base).

        Raises:
            LoraAdapterError: `lora_id` was never added on this rank.
        """
        if lora_id and lora_id not in self.known:
            raise LoraAdapterError(f"LoRA adapter id {lora_id} is not loaded")
        self.row_ids[row] = lora_id
        if lora_id:
            self.live[lora_id] += 1

    def remove_row(self, row: int) -> None:
        lora_id = int(self.row_ids[row])
        self.row_ids[row] = 0
        if lora_id:
            self.live[lora_id] -= 1
            if not self.live[lora_id]:
                del self.live[lora_id]
                if lora_id in self.unloaded:
                    self._drop(lora_id)

    # -- one step ------------------------------------------------------------------------------

    def prepare(self, rows: np.ndarray, counts: np.ndarray) -> bool:
        """Put the step's adapters in slots and group its tokens by slot; whether any row of
        the step has an adapter (False: the base model alone, `batch` empty)."""
        ids = self.row_ids[rows]
        if not ids.any():
            self.batch.clear()
            return False
        self._clock += 1
        self._failed.clear()
        slot_by_id = {0: -1}
        for lora_id in np.unique(ids).tolist():
            if lora_id:
                try:
                    slot_by_id[lora_id] = self._slot_for(lora_id)
                except LoraAdapterError as exc:  # its requests fail, not the step
                    self._failed[lora_id] = str(exc)
                    slot_by_id[lora_id] = -1
        slots = np.fromiter((slot_by_id[i] for i in ids.tolist()), np.int64, len(ids))
        self.batch.set(np.repeat(slots, counts), self.device)
        return True

    def take_failures(self, rows: np.ndarray, rnums: np.ndarray) -> dict[int, str]:
        """The requests (rnum -> why) among the step's `rows` (with their `rnums`) whose
        adapter `prepare` could not read; forgotten once taken."""
        if not self._failed:
            return {}
        ids = self.row_ids[rows].tolist()
        failed, self._failed = self._failed, {}
        return {int(r): failed[i] for r, i in zip(rnums.tolist(), ids, strict=True) if i in failed}

    def _slot_for(self, lora_id: int) -> int:
        slot = self.slot_of.get(lora_id)
        if slot is None:
            slot = self._free_or_evict()
            self._load(slot, lora_id)
        self._slot_clock[slot] = self._clock
        return slot

    def _free_or_evict(self) -> int:
        if 0 in self.slot_ids:
            return self.slot_ids.index(0)
        idle = [s for s, i in enumerate(self.slot_ids) if not self.live[i] or i in self.unloaded]
        idle = [s for s in idle if self._slot_clock[s] != self._clock]
        if not idle:
            raise LoraSlotsFullError(
                f"a step needs more than --max-loras {len(self.slot_ids)} adapters in slots"
            )
        slot = min(idle, key=self._slot_clock.__getitem__)  # least recently used
        self._free_slot(slot)
        return slot

    def _free_slot(self, slot: int) -> None:
        del self.slot_of[self.slot_ids[slot]]
        self.slot_ids[slot] = 0

    def _load(self, slot: int, lora_id: int) -> None:
        """Copy adapter `lora_id` into `slot` (read again if host memory dropped it).

        Raises:
            LoraAdapterError: it had to be read again, and that failed (nothing changed).
        """
        adapter = self.host.get(lora_id)
        if adapter is None:
            module, cache_dir = self.known[lora_id], self.cache_dir
            adapter = read_adapter(module, self.model_config, self.max_rank, cache_dir=cache_dir)
        self._keep_in_host(adapter)
        for layer, name, linear in self.linears:
            linear.set_slot(slot, [adapter.weights.get((layer, t)) for t in _PARTS[name]])
        self.slot_ids[slot] = lora_id
        self.slot_of[lora_id] = slot
        self.num_loads += 1
