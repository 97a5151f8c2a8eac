"""How many bytes the KV cache may take on a CUDA device, from what a profile run measured.

The cache is sized before the decode graphs are captured (they are captured over it, so
they cannot come first), so what the graphs and torch will take after it must be kept
free at sizing, or a 0.9 `--gpu-memory-utilization` runs out of memory at the capture or
the first large step:

- **reserved, not allocated**: the profile forward's peak counted with
  `max_memory_reserved` (the caching allocator's segments: fragmentation, and the default
  stream's cuBLAS workspace, which it allocates), not `max_memory_allocated`;
- **the graph pool**: a margin sized from an eager forward of the largest captured batch,
  run after the profile (`graph_activations`: its peak allocation above what was allocated
  before it; the graphs share one pool, which the largest one's intermediates bound), plus
  `CAPTURE_WORKSPACE` for the capture stream's own cuBLAS workspace and the graphs' nodes.

The capture line says what the pool took beside the margin kept (`margin_note`), so a
device run shows whether the margin held. vLLM V1 keeps no margin by default and warns;
this keeps one, measured.
"""

from __future__ import annotations

from dataclasses import dataclass

CAPTURE_WORKSPACE = 64 << 20


@dataclass(frozen=True)
class DeviceMemory:
    """A device's numbers at sizing time, in bytes."""

    total: int
    free_at_start: int  # before this process allocated anything: others' use is the rest
    peak_reserved: int  # `max_memory_reserved` over the profile runs
    graph_activations: int  # the largest captured batch's eager peak (0: no graphs)

    @property
    def graph_margin(self) -> int:
        """What is kept free for the decode graphs' pool (0 when none is captured)."""
        return self.graph_activations + CAPTURE_WORKSPACE if self.graph_activations else 0


def kv_budget(memory: DeviceMemory, utilization: float) -> int:
    """Bytes the KV cache may take: `utilization` of the device, less what other processes
    held at start, what this one reserved at its peak, and the graphs' margin."""
    used_outside = memory.total - memory.free_at_start
    return (
        int(memory.total * utilization) - used_outside - memory.peak_reserved - memory.graph_margin
    )


def margin_note(pool_bytes: int, margin: int) -> str:
    """The capture line's note: the pool's size against the margin kept at sizing."""
    if not margin:
        return ""
    held = "within" if pool_bytes <= margin else "OVER"
    return f"; {held} the {margin / 2**20:.0f} MiB kept for them when the KV cache was sized"
