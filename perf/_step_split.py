"""Where a batched CPU step's time goes, and its GFLOP/s against the machine's FMA peak.

Issue 32: at 32 decodes the step is compute-bound on two cores, so the figure to raise is
the share of the FMA peak it reaches. Two kinds of step are split, on the worker's real
runner (`decode_profile.py --split`):
- a decode step of B sequences, which the C step runs in one call: its products are timed
  again alone (`TiledLinear` over the same tiles at M = B, the gate/up tiles interleaved as
  the step reads them), and the rest of the call is attention with its norms, rotary and KV
  writes;
- a mixed step, the B decodes and one new prompt of P tokens, which the torch forward runs
  (oneDNN's linears, C's attention): linears and attention are timed at their calls.
Both then add the LM head (a linear, counted with the linears), sampling, and the host work
between (the step's wall time less the parts: inputs, embedding, outputs, norms and rotary
of the torch forward). The wrappers add two clock reads per call (121 calls a torch step).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from model_bench import Driver, DriverRequest, SamplingOptions

from trillm.gpu import Worker
from trillm.gpu.cpu import _cpu_decode
from trillm.gpu.cpu._tiles import BF16, BF16_AMX, F32, TiledLinear
from trillm.gpu.layers import _layers

PARTS = ("linears", "attention", "sampling", "host")


class Clock:
    """Seconds per named part, accumulated over the wrapped calls of one step at a time, by
    `clock` (wall time, or the process's CPU time on one thread, for a busy machine)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.now: defaultdict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.inside = False  # in a timed call: one it makes (the head's linear) is its own

    def timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if self.inside:
                return fn(*args, **kwargs)
            self.inside, t0 = True, self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[part] += self.clock() - t0
                self.inside = False

        return run

    def close_step(self, wall: float) -> None:
        self.steps.append({**self.now, "wall": wall})
        self.now = defaultdict(float)


@contextmanager
def _patched(obj: object, name: str, value: object) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def timed_steps(
    worker: Worker, requests: list[DriverRequest], clock: Clock
) -> list[dict[str, float]]:
    """Drive `requests` through the runner; each step's time and its timed parts."""
    runner = worker.runner
    step, head = runner.cpu_step, runner.cpu_step or runner.model
    assert step is not None and head is not None
    execute = runner.execute

    def execute_timed(batch: Any) -> Any:
        t0 = clock.clock()
        out = execute(batch)
        clock.close_step(clock.clock() - t0)
        return out

    with ExitStack() as stack:
        for obj, name, part in (
            (runner, "sampler", "sampling"),
            (head, "compute_logits", "head"),
            (step, "run", "c_step"),
            (_layers, "_linear", "linears"),
            (_cpu_decode.CAttention, "attend_qkv", "attention"),
        ):
            stack.enter_context(_patched(obj, name, clock.timed(part, getattr(obj, name))))
        stack.enter_context(_patched(runner, "execute", execute_timed))
        Driver(runner, runner.kv_caches[0][0].shape[0]).run(requests)
    return clock.steps


def products_alone(
    worker: Worker, batch: int, repeats: int, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Median seconds of the C step's products (every layer's four) at M = `batch`."""
    step = worker.runner.cpu_step
    assert step is not None
    linears = []
    for w in step.layers:
        assert w.gate_up is not None and w.down is not None
        for tiles in (w.qkv, w.o, w.gate_up, w.down):  # dense: [N / 16, K * 16] elements
            if tiles.kind not in (F32, BF16, BF16_AMX):
                raise ValueError("products_alone times dense (float32, bfloat16) tiles only")
            n, k = tiles.data.shape[0] * 16, tiles.data.shape[1] // 16
            linears.append((TiledLinear(tiles, n), k))
    xs = {k: torch.randn(batch, k) for k in {k for _, k in linears}}
    times = []
    for _ in range(repeats + 1):
        t0 = clock()
        for linear, k in linears:
            linear(xs[k])
        times.append(clock() - t0)
    return statistics.median(times[1:])


def step_flops(config: Any, decodes: int, context: int, prompt: int) -> dict[str, float]:
    """FLOPs of a step of `decodes` decodes at `context` and one `prompt`-token prompt
    (0: none): the linears (the head on one row per sequence) and attention."""
    h, layers, heads = config.hidden_size, config.num_layers, config.num_heads
    q, kv = heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_token = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    rows = decodes + (1 if prompt else 0)
    linears = 2 * (decodes + prompt) * per_token * layers + 2 * rows * h * config.vocab_size
    keys = decodes * context + prompt * (prompt + 1) // 2
    return {"linears": float(linears), "attention": float(2 * 2 * q * keys * layers)}


def split(steps: list[dict[str, float]], products: float | None) -> dict[str, float]:
    """Median seconds of each part over `steps` (each step split first, so that its host
    work is its own wall time less its own parts). With `products` (the C step's, timed
    alone), the C call is split into them and attention."""
    rows = []
    for s in steps:
        head, sampling = s.get("head", 0.0), s.get("sampling", 0.0)
        if products is not None:  # the C step: one call, its products known from their run
            linears, attention = products + head, s.get("c_step", 0.0) - products
        else:
            linears, attention = s.get("linears", 0.0) + head, s.get("attention", 0.0)
        host = s["wall"] - linears - attention - sampling
        row = {"linears": linears, "attention": attention, "sampling": sampling, "host": host}
        rows.append({**row, "wall": s["wall"]})
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def decode_and_mixed(
    worker: Worker,
    batch: list[list[int]],
    steps: int,
    greedy: SamplingOptions,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """Decode and mixed steps of one run: B sequences decode `steps` tokens while a new
    prompt (as long as theirs) arrives every other step from the third."""
    base = [DriverRequest(i, p, steps, greedy) for i, p in enumerate(batch)]
    extra = [
        DriverRequest(len(batch) + j, batch[j % len(batch)][::-1], 1, greedy, arrival_step=s)
        for j, s in enumerate(range(2, steps - 1, 2))
    ]
    timed = timed_steps(worker, base + extra, Clock(clock))
    arrivals = {r.arrival_step for r in extra}
    mixed = [s for i, s in enumerate(timed) if i in arrivals]
    decode = [s for i, s in enumerate(timed) if i and i not in arrivals]
    return decode, mixed
