"""No Triton kernel compiles mid-serving: every launch of a kernel over steps of different
shapes falls in the same compiled variant.

Triton compiles a variant per specialisation key of a kernel's arguments: an int is a
constant when it is 1, and is marked when divisible by 16; a pointer is marked when 16-byte
aligned (about a second each on a GPU). An argument that follows the step's shape (tokens,
block-table width) would meet a new key in the middle of serving unless it is in the
kernel's `do_not_specialize`. The test records every launch of the model's forward (Llama
with the triton backend, with and without the fused kernels, under the interpreter) over
steps of different shapes and computes each launch's key with Triton's own function
(`native_specialize_impl`, what the compiled launcher keys its cache by).
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from tests.gpu.conftest import make_runner, save_tiny
from trillm.gpu.attention import _triton_kernels as kernels
from trillm.gpu.layers import _fused_kernels as fused

pytestmark = pytest.mark.skipif(
    not kernels.INTERPRETED, reason="records launches through Triton's interpreter (CPU)"
)

KERNELS = [
    kernels._write_kv_kernel,
    kernels._attention_kernel,
    kernels._reduce_segments_kernel,
    fused._rms_norm_kernel,
    fused._silu_mul_kernel,
    fused._rope_write_kv_kernel,
]

# (query tokens per sequence, context after the step): a decode at one block, three decodes
# over three blocks, a mixed step (a prompt, a chunk, a decode), one with 16 tokens in all.
STEPS = [
    ([1], [3]),
    ([1, 1, 1], [20, 9, 17]),
    ([5, 3, 1], [5, 7, 19]),
    ([13, 3], [13, 23]),
]
BLOCK = 8


def _record(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[dict[str, Any]]]:
    """Every launch's arguments by name, per kernel (the launches still run)."""
    launches: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for kernel in KERNELS:

        def run(*args: Any, _kernel: Any = kernel, _run: Callable[..., Any] = kernel.run,
                **kwargs: Any) -> Any:  # fmt: skip
            named = dict(zip(_kernel.arg_names, args, strict=False))
            launches[_kernel.__name__].append(named | kwargs | {"kernel": _kernel})
            return _run(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", run)
    return launches


def _runtime_params(kernel: Any) -> list[str]:
    params = inspect.signature(kernel.fn).parameters
    return [p for p in params if "constexpr" not in str(params[p].annotation)]


def _key(kernel: Any, call: dict[str, Any]) -> tuple[tuple[str, object], ...]:
    """The launch's specialisation key over its runtime arguments, as Triton computes it."""
    off = set(kernel.kwargs.get("do_not_specialize") or ())
    return tuple(
        (name, native_specialize_impl(BaseBackend, call[name], False, name not in off, True))
        for name in _runtime_params(kernel)
    )


def _differences(kernel: Any, keys: set[tuple[tuple[str, object], ...]]) -> dict[str, Any]:
    by_arg = [dict(key) for key in keys]
    return {
        name: {str(k[name]) for k in by_arg}
        for name in _runtime_params(kernel)
        if len({str(k[name]) for k in by_arg}) > 1
    }


def _changing_ints(kernel: Any, calls: list[dict[str, Any]]) -> set[str]:
    return {
        name
        for name in _runtime_params(kernel)
        if all(type(call[name]) is int for call in calls) and len({c[name] for c in calls}) > 1
    }


def _step(runner: Any, counts: list[int], contexts: list[int], segments: int) -> None:
    n = np.array(counts)
    ctx = np.array(contexts)
    width = int(-(-ctx.max() // BLOCK))
    tables = np.arange(len(n) * width, dtype=np.int32).reshape(len(n), width)
    positions = np.concatenate([np.arange(c - k, c) for k, c in zip(n, ctx, strict=True)])
    seq = np.repeat(np.arange(len(n)), n)
    slots = tables[seq, positions // BLOCK] * BLOCK + positions % BLOCK
    runner.attention.forced_segments = segments
    meta = runner.attention.metadata(n, ctx, tables, slots, torch.from_numpy)
    ids = torch.from_numpy(50 + positions * 3 + seq)
    with torch.inference_mode():
        runner.model(ids, torch.from_numpy(positions), runner.kv_caches, meta)


def test_each_kernel_compiles_one_variant_over_steps_of_any_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = make_runner(
        save_tiny(tmp_path, "llama"), attention_backend="triton", enforce_eager=True,
        num_blocks=16, block_size=BLOCK, cpu_linear="aten",
    )  # fmt: skip
    changing: dict[str, set[str]] = defaultdict(set)
    # The fused kernels on (CUDA's choice with the triton backend) and off (the attention
    # backend's own KV write): a choice made at load, so each mode's steps are compared.
    for fused_on in (True, False):
        runner.model.use_fused(fused_on)
        with monkeypatch.context() as patch:
            launches = _record(patch)
            for i, (counts, contexts) in enumerate(STEPS):
                _step(runner, counts, contexts, segments=2 if i == 1 else 1)  # decodes: split KV
        for name, calls in launches.items():
            kernel = calls[0]["kernel"]
            keys = {_key(kernel, call) for call in calls}
            assert len(keys) == 1, (
                f"{name} (fused kernels {'on' if fused_on else 'off'}) compiles "
                f"{len(keys)} variants over the steps: {_differences(kernel, keys)}"
            )
            changing[name] |= _changing_ints(kernel, calls)
    assert set(changing) == {k.__name__ for k in KERNELS}, "a kernel never ran"
    # the shapes did change what they should (else the test proves nothing)
    assert "num_tokens" in changing["_write_kv_kernel"] | changing["_rope_write_kv_kernel"]
    assert "stride_bt" in changing["_attention_kernel"]
