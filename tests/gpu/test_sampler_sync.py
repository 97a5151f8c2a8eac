"""The sampler never waits for the device: `SamplingBatch.build` and `Sampler` read nothing back.

On the CPU, `no_host_reads()` makes every way Python reads a tensor's value raise (`.item()`,
`.tolist()`, `.cpu()`, `.numpy()`, `.nonzero()`, `torch.nonzero`, `bool()` / `int()` /
`float()` / `__index__` of a tensor) and, below Python, every aten op that reads a value back
or sizes its output by the data (`_local_scalar_dense`, `nonzero`, boolean-mask indexing,
`unique`, `masked_select`), caught by a dispatch mode. Deliberate controls show each of
these raising inside the guard, and a sync put into the sampler failing the test. Reads made
inside a C++ kernel (`masked_fill` by a 0-dim tensor value, CUDA's `index_put_` with
accumulate) are beyond it: on CUDA the same build and sample run under
`torch.cuda.set_sync_debug_mode("error")`, which raises on any synchronising CUDA call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode  # private, but stable since 1.13

from trillm.common.wire import SamplingOptions
from trillm.gpu.runner._pinned import HostStaging
from trillm.gpu.sample import _sampler
from trillm.gpu.sample._sampler import Sampler, SamplerOutput
from trillm.gpu.sample._sampling_batch import RequestSamplingState, SamplingBatch

CPU = torch.device("cpu")
VOCAB = 1000
EOS = 2
sampler = Sampler()


class HostReadError(AssertionError):
    """A tensor's value was read on the host inside `no_host_reads()`."""


_PYTHON_READS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__")
_PYTHON_READS += ("__index__",)
_ATEN_READS = {
    "_local_scalar_dense",  # .item(), int(), bool() of a tensor
    "nonzero",
    "nonzero_static",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "repeat_interleave",  # without output_size it counts on the host
}
_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}


class _RecordOps(TorchDispatchMode):
    """Records every aten op; raises on those that read a device value back."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = func.overloadpacket.__name__
        self.ops.add(name)
        if name in _ATEN_READS:
            raise HostReadError(f"{func} reads a device value back")
        if name in _INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        ):
            raise HostReadError(f"{func} with a boolean mask sizes its output on the host")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_reads() -> Iterator[_RecordOps]:
    """Inside: any host read of a tensor's value raises HostReadError; yields the op record."""

    def forbidden(name: str) -> Callable[..., Any]:
        def read(*args: Any, **kwargs: Any) -> Any:
            raise HostReadError(f"{name} reads a device value back")

        return read

    with pytest.MonkeyPatch.context() as patch:
        for name in _PYTHON_READS:
            patch.setattr(torch.Tensor, name, forbidden(f"Tensor.{name}"))
        patch.setattr(torch, "nonzero", forbidden("torch.nonzero"))
        with _RecordOps() as record:
            yield record


CONTROLS: dict[str, Callable[[torch.Tensor], object]] = {
    "item": lambda t: t.sum().item(),
    "tolist": lambda t: t.tolist(),
    "cpu": lambda t: t.cpu(),
    "numpy": lambda t: t.numpy(),
    "Tensor.nonzero": lambda t: t.nonzero(),
    "torch.nonzero": lambda t: torch.nonzero(t),
    "bool": lambda t: bool(t[0] > 0),
    "if": lambda t: 1 if t.max() > 0 else 0,
    "int": lambda t: int(t[0]),
    "float": lambda t: float(t[0]),
    "index": lambda t: list(range(8))[t.argmax()],
    "boolean mask": lambda t: t[t > 0],
    "unique": lambda t: torch.unique(t),
    "index_put_ by mask": lambda t: t.clone().index_put_((t > 0,), torch.tensor(0.0)),
}


@pytest.mark.parametrize("read", list(CONTROLS.values()), ids=list(CONTROLS))
def test_the_guard_catches_each_kind_of_host_read(read: Callable[[torch.Tensor], object]) -> None:
    t = torch.randn(8)
    with pytest.raises(HostReadError), no_host_reads():
        read(t)
    read(t)  # and the guard is gone after it


# --- a mixed batch, every option ---------------------------------------------------------------

MIXED: list[dict[str, Any]] = [
    {"temperature": 0.0},
    {"temperature": 0.0, "logprobs": 3, "logit_bias": ((5, 4.0), (9, -2.0))},
    {"temperature": 0.0, "min_tokens": 9, "stop_token_ids": (11,), "repetition_penalty": 1.3},
    {"temperature": 0.0, "presence_penalty": 0.5, "frequency_penalty": 0.2, "min_tokens": 1},
    {"temperature": 0.7},
    {"temperature": 1.2, "top_k": 20, "seed": 7},
    {"top_k": 30, "top_p": 0.8, "seed": 8, "logprobs": 0},
    {"min_p": 0.1, "seed": 9, "repetition_penalty": 0.9, "logit_bias": ((3, 1.5),)},
    {"temperature": 0.5, "top_k": 1},  # random, but only the argmax survives
    {"temperature": 0.9, "top_k": 40, "top_p": 1e-6},  # likewise
]
# Top-p rows all set top_k (top-p over topk candidates), or one does not (bisection).
CANDIDATES = [{"top_k": 50, "top_p": 0.9, "min_p": 0.05}]
BISECTION = [{"top_p": 0.9, "frequency_penalty": 0.3}, {"temperature": 0.8, "top_p": 1e-6}]
COMPOSITIONS = {"top-p among top-k": MIXED + CANDIDATES, "top-p by bisection": MIXED + BISECTION}


def deterministic(options: list[dict[str, Any]]) -> list[int]:
    """The rows whose token does not depend on the draw: greedy, top_k 1, top_p 1e-6."""
    return [
        i
        for i, o in enumerate(options)
        if o.get("temperature") == 0.0 or o.get("top_k") == 1 or o.get("top_p", 1.0) <= 1e-6
    ]


def mixed_rows(options: list[dict[str, Any]], device: torch.device) -> list[RequestSamplingState]:
    rows = []
    for i, o in enumerate(options):
        row = RequestSamplingState(
            SamplingOptions(**o), np.arange(i, 40 + i, dtype=np.int32), device
        )
        row.output_token_ids.extend(range(3 * i, 3 * i + 5))
        rows.append(row)
    return rows


def build(rows: list[RequestSamplingState], device: torch.device) -> SamplingBatch:
    return SamplingBatch.build(rows, eos_token_id=EOS, vocab_size=VOCAB, device=device)


def step_logits(num_rows: int, step: int) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(step)) * 3


@pytest.mark.parametrize("composition", list(COMPOSITIONS))
def test_build_and_sample_read_nothing_back_on_cpu(composition: str) -> None:
    rows = mixed_rows(COMPOSITIONS[composition], CPU)
    for step in range(3):
        logits = step_logits(len(rows), step)
        with no_host_reads() as record:
            batch = build(rows, CPU)
            out = sampler(logits, batch)
        assert batch.random is not None
        assert batch.random.top_p_rows_set_top_k == (composition == "top-p among top-k")
        assert batch.any_min_tokens and batch.any_penalties and batch.any_logit_bias
        assert "sort" not in record.ops  # top-p without the full-vocabulary sort
        assert {"topk", "exponential_", "index_add_", "index_fill_"} <= record.ops
        assert out.logprobs is not None and out.topk_ids is not None
        for row, token in zip(rows, out.token_ids.tolist(), strict=True):
            row.output_token_ids.append(token)


def test_a_sync_put_into_the_sampler_fails_the_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    kth_largest = _sampler._kth_largest

    def syncing(largest: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
        int(top_k.max())  # as a host-side "if any row ..." would
        return kth_largest(largest, top_k, max_top_k)

    monkeypatch.setattr(_sampler, "_kth_largest", syncing)
    rows = mixed_rows(COMPOSITIONS["top-p among top-k"], CPU)
    with pytest.raises(HostReadError, match="reads a device value back"), no_host_reads():
        sampler(step_logits(len(rows), 0), build(rows, CPU))


def test_host_staging_packs_each_array_at_an_aligned_offset() -> None:
    arrays = [
        np.array([1, -2, 3], np.int64),
        np.array([0.5, -1.5], np.float32),
        np.zeros(0, np.int64),
        np.array([7], np.int32),
        np.array([2**40, 5], np.int64),
    ]
    staging = HostStaging()
    slots = [staging.add(a) for a in arrays]
    buffer = np.zeros(staging.nbytes, np.uint8)
    staging.pack_into(buffer)
    views = staging.views(torch.from_numpy(buffer))
    for slot, array in zip(slots, arrays, strict=True):
        assert views[slot].dtype == torch.from_numpy(array).dtype
        assert views[slot].tolist() == array.tolist()
    with pytest.raises(TypeError, match="cannot stage a float64 array; use int32, int64"):
        staging.add(np.zeros(2))


# --- CUDA ----------------------------------------------------------------------------------


def batch_tensors(batch: SamplingBatch) -> dict[str, torch.Tensor]:
    """Every tensor of a batch, by field path."""
    found = {}
    for group in ("random", "logit_bias", "min_tokens_mask", "penalties"):
        record = getattr(batch, group)
        for field in getattr(record, "__slots__", ()):
            value = getattr(record, field)
            if isinstance(value, torch.Tensor):
                found[f"{group}.{field}"] = value
    return found


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (perf/gpu_check.sh)")
@pytest.mark.parametrize("composition", list(COMPOSITIONS))
def test_build_and_sample_do_not_sync_on_cuda(composition: str) -> None:
    cuda = torch.device("cuda")
    options = COMPOSITIONS[composition]
    cpu_rows, cuda_rows = mixed_rows(options, CPU), mixed_rows(options, cuda)
    logits = step_logits(len(options), 0)
    on_cuda = logits.to(cuda)
    sampler(on_cuda, build(mixed_rows(options, cuda), cuda))  # warm-up: lazy CUDA init
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = build(cuda_rows, cuda)
        out: SamplerOutput = sampler(on_cuda, batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want_batch = build(cpu_rows, CPU)
    want = sampler(logits, want_batch)
    got, expected = batch_tensors(batch), batch_tensors(want_batch)
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor.cpu(), expected[name]), name
    tokens = out.token_ids.cpu()
    rows = deterministic(options)
    assert tokens[rows].tolist() == want.token_ids[rows].tolist()
    assert ((tokens >= 0) & (tokens < VOCAB)).all()
