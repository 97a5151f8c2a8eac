"""Kernels per decode step, counted without a GPU, for `gpu_bench.py --count-launches`.

At batch 1 a decode step of a 1B model is launch-bound: each kernel reads little, and the
host's launch time (a few microseconds each) adds up past the HBM roofline. How many launches
a step makes says what CUDA graphs (one launch) and fused kernels can save, and it can be
counted on the CPU: a `TorchDispatchMode` sees every aten op the eager forward calls, and the
Triton kernels are counted by wrapping them. An op that only makes a view or allocates
(`view`, `t`, `empty`, ...) launches nothing; every other op launches one kernel on CUDA
(a few launch two or more: this is an estimate). Forward hooks on the decoder layers give
the count per layer. On CUDA, `torch.profiler` counts the kernels that really ran, eager and
in a CUDA-graph replay.

Not seen here: the host-to-device copies of the step's inputs (ids, positions, slots, block
table, attention metadata), which on the CPU are no copies at all.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that allocate or describe memory and launch nothing (views are found by `is_view`).
NO_KERNEL = frozenset(
    {
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
        "alias", "lift_fresh", "set_", "resize_", "_reshape_alias", "_unsafe_view",
    }
)  # fmt: skip
SYNCS = frozenset({"_local_scalar_dense"})  # .item(): a device-to-host copy and a wait


def launches(func: torch._ops.OpOverload) -> bool:
    """Whether aten op `func` runs a kernel (on CUDA), as opposed to a view or allocation."""
    name = func.overloadpacket.__name__
    return not (func.is_view or name in NO_KERNEL or name in SYNCS)


class LaunchCounter(TorchDispatchMode):
    """Counts the launching aten ops and the Triton kernels by region: "layer" (inside a
    decoder layer: `layer_ops` also by layer index) or "rest" (embedding, final norm, logits,
    sampling, input preparation)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer: int | None = None
        self.paused = 0
        self.by_region: Counter[str] = Counter()
        self.by_layer: Counter[int] = Counter()
        self.by_op: Counter[str] = Counter()  # in layers: what the layers are made of
        self.rest_ops: Counter[str] = Counter()  # outside them
        self.syncs = 0

    def count(self, name: str) -> None:
        self.by_region["layer" if self.layer is not None else "rest"] += 1
        if self.layer is not None:
            self.by_layer[self.layer] += 1
            self.by_op[name] += 1
        else:
            self.rest_ops[name] += 1

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            if func.overloadpacket.__name__ in SYNCS:
                self.syncs += 1
            elif launches(func):
                self.count(f"aten.{func.overloadpacket.__name__}")
        return out

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """No counting inside (Triton's interpreter runs torch ops of its own on CPU)."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


@contextlib.contextmanager
def counting_triton(counter: LaunchCounter) -> Iterator[None]:
    """Each launch `kernel[grid](...)` of trillm's Triton kernels (the attention's and the
    fused ones) counted as one."""
    from trillm.gpu.attention import _triton_kernels
    from trillm.gpu.layers import _fused_kernels

    originals = {
        (module, name): obj
        for module in (_triton_kernels, _fused_kernels)
        for name, obj in vars(module).items()
        if name.endswith("_kernel") and hasattr(obj, "__getitem__")
    }

    class Counted:
        def __init__(self, name: str, kernel: Any) -> None:
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            launch = self.kernel[grid]

            def run(*args: Any, **kwargs: Any) -> Any:
                counter.count(f"triton.{self.name}")
                with counter.pause():
                    return launch(*args, **kwargs)

            return run

    for (module, name), kernel in originals.items():
        setattr(module, name, Counted(name, kernel))
    try:
        yield
    finally:
        for (module, name), kernel in originals.items():
            setattr(module, name, kernel)


@contextlib.contextmanager
def layer_regions(model: torch.nn.Module, counter: LaunchCounter) -> Iterator[None]:
    """The counter told which decoder layer runs, by forward hooks on each (and by wrapping
    `forward_fused`, which the fused path calls directly: it returns two tensors)."""
    handles = []
    layers = model.decoder_layers()  # type: ignore[operator]
    for index, layer in enumerate(layers):

        def fused(*args: Any, index: int = index, plain: Any = layer.forward_fused) -> Any:
            counter.layer = index
            try:
                return plain(*args)
            finally:
                counter.layer = None

        layer.forward_fused = fused

        def enter(module: Any, args: Any, index: int = index) -> None:
            counter.layer = index

        def leave(module: Any, args: Any, output: Any) -> None:
            counter.layer = None

        handles += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for layer in layers:
            del layer.forward_fused  # the instance's wrapper: the class's method again


def count_step(model: torch.nn.Module, step: Callable[[], Any]) -> dict[str, Any]:
    """The launches of one call of `step` (one decode step of the runner of `model`)."""
    counter = LaunchCounter()
    with layer_regions(model, counter), counting_triton(counter), counter:
        step()
    layers = [counter.by_layer[i] for i in range(len(model.decoder_layers()))]  # type: ignore[operator]
    return {
        "per_step": sum(counter.by_region.values()),
        "in_layers": counter.by_region["layer"],
        "outside_layers": counter.by_region["rest"],
        "per_layer": layers[0] if len(set(layers)) == 1 else layers,
        "layer_ops": {k: v // len(layers) for k, v in counter.by_op.most_common()},
        "outside_ops": dict(counter.rest_ops.most_common()),
        "syncs": counter.syncs,
    }


def cuda_kernels(step: Callable[[], Any]) -> dict[str, int]:
    """Kernels, copies and memsets that ran on the GPU in one call of `step` (torch.profiler;
    a CUDA-graph replay's kernels are traced one by one)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    copies = sum(n.startswith(("Memcpy", "Memset")) for n in names)
    return {"kernels": len(names) - copies, "copies": copies}


def count_decode(runner: Any, batch: int, context: int, steps: int) -> dict[str, Any]:
    """Launches of the decode steps of `batch` prompts of `context` tokens, after the prefill
    (not counted): the first decode step's counts, and whether every step made as many. On
    CUDA the last step runs under torch.profiler instead: the kernels that really ran."""
    import numpy as np

    from tests.gpu.driver import Driver, DriverRequest
    from trillm.gpu import StepBatch

    execute, model = runner.execute, runner.model
    counts: list[dict[str, Any]] = []
    profiled: list[dict[str, int]] = []
    calls = [0]

    def counted(step: StepBatch, *rest: Any) -> Any:
        calls[0] += 1
        out: list[Any] = []
        if calls[0] == 1:  # the prefill
            return execute(step, *rest)
        if runner.device.type == "cuda" and calls[0] == steps + 1:
            profiled.append(cuda_kernels(lambda: out.append(execute(step, *rest))))
        else:
            counts.append(count_step(model, lambda: out.append(execute(step, *rest))))
        return out[0]

    vocab = runner.model_config.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(100, vocab - 1, (batch, context), generator=g).tolist()
    requests = [DriverRequest(50_000 + i, p, steps + 1) for i, p in enumerate(prompts)]
    runner.execute = counted
    try:
        Driver(runner, runner.kv_caches[0][0].shape[0]).run(requests)
    finally:
        runner.execute = execute
    rnums = np.array([r.rnum for r in requests], np.uint64)
    execute(StepBatch(10**6, finished_rnums=rnums))  # the driver never says "finished"
    first = counts[0]
    return {
        "batch": batch,
        "context": context,
        "steps_counted": len(counts),
        "same_every_step": all(c["per_step"] == first["per_step"] for c in counts),
        **first,
        "cuda_profiler": profiled[0] if profiled else None,
    }


def count_mixed(runner: Any, batch: int, context: int, prompt: int) -> dict[str, Any]:
    """Launches of a mixed step: `batch` sequences decoding (after their `context`-token
    prefill) beside a new prompt of `prompt` tokens prefilled whole, the step CUDA runs eager
    (no graph takes it). CPU counts only."""
    import numpy as np

    from tests.gpu.driver import Driver, DriverRequest
    from trillm.gpu import StepBatch

    execute, model = runner.execute, runner.model
    counts: list[dict[str, Any]] = []
    calls = [0]

    def counted(step: StepBatch, *rest: Any) -> Any:
        calls[0] += 1
        if calls[0] != 2:  # the first step prefills the decoders; the second is mixed
            return execute(step, *rest)
        out: list[Any] = []
        counts.append(count_step(model, lambda: out.append(execute(step, *rest))))
        return out[0]

    vocab = runner.model_config.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(100, vocab - 1, (batch + 1, max(context, prompt)), generator=g)
    requests = [DriverRequest(60_000 + i, prompts[i, :context].tolist(), 3) for i in range(batch)]
    requests.append(
        DriverRequest(60_000 + batch, prompts[batch, :prompt].tolist(), 2, arrival_step=1)
    )
    runner.execute = counted
    try:
        Driver(runner, runner.kv_caches[0][0].shape[0]).run(requests)
    finally:
        runner.execute = execute
    rnums = np.array([r.rnum for r in requests], np.uint64)
    execute(StepBatch(10**6, finished_rnums=rnums))
    return {"batch": batch, "context": context, "prompt": prompt, **counts[0]}
