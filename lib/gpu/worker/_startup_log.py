"""The worker's start-up, timed: one line per phase and the total, on rank 0's stderr.

A start-up that took 11 s one day and 33 s another says nothing about why; these lines do:
device and process group, reading the checkpoint, building the model and loading its weights,
the C kernels (built, or found in the cache), packing the linears for oneDNN, timing the CPU
decode paths (or reading the last timing, `_decode_probe`), the profile run that sizes the KV
cache (CUDA), the KV cache itself and the CUDA graphs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


class StartupLog:
    """Times named phases; `phase` prints each as it ends, `total` the sum since creation."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.started = time.monotonic()
        self.phases: list[tuple[str, float]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[list[str]]:
        """Time the block; words the block appends to the yielded list follow the name
        ("C kernels: built decode_step")."""
        notes: list[str] = []
        began = time.monotonic()
        yield notes
        self.record(" ".join([name, *notes]), time.monotonic() - began)

    def record(self, name: str, seconds: float) -> None:
        self.phases.append((name, seconds))
        self._print(f"start-up: {name}: {seconds:.2f} s")

    def total(self) -> float:
        """Print and return the seconds since this log began."""
        seconds = time.monotonic() - self.started
        self._print(f"start-up: worker ready in {seconds:.2f} s")
        return seconds

    def _print(self, line: str) -> None:
        if self.enabled:
            print(f"trillm: {line}", file=sys.stderr, flush=True)
