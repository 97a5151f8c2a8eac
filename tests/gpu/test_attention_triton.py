"""The triton attention backend against the torch reference, under Triton's interpreter on CPU.

Each case builds one step of a mixed batch (prefills from scratch, prefill chunks after a
cached context, decodes) over a KV cache with scattered blocks, runs both backends on copies
of the cache, and compares the outputs and the written caches. The same cases run compiled on
CUDA in `test_cuda.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trillm.gpu._attention import TorchAttention
from trillm.gpu._attention_triton import TritonAttention

pytestmark = pytest.mark.timeout(300)


@dataclass
class Step:
    """One step's attention inputs; `seqs` is (tokens already cached, tokens this step)."""

    seqs: list[tuple[int, int]]
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    seed: int = 0

    def run(self, segments: int | None = None, device: str = "cpu") -> tuple[float, float]:
        """Max |triton - torch| over the outputs, and over the caches after the KV write."""
        g = torch.Generator().manual_seed(self.seed)
        rng = np.random.default_rng(self.seed)
        bs, kv_heads, dim = self.block_size, self.num_kv_heads, self.head_dim
        counts = np.array([c for _, c in self.seqs], np.int64)
        context = np.array([a + c for a, c in self.seqs], np.int64)
        blocks = [-(-int(n) // bs) for n in context]
        num_blocks = sum(blocks) + 3  # some blocks belong to nobody
        order = rng.permutation(num_blocks)
        tables = np.zeros((len(self.seqs), max(blocks) + 2), np.int32)
        start = 0
        for i, n in enumerate(blocks):
            tables[i, :n] = order[start : start + n]
            start += n
        pos = np.concatenate([np.arange(a, a + c) for a, c in self.seqs])
        rows = np.repeat(np.arange(len(self.seqs)), counts)
        slots = tables[rows, pos // bs].astype(np.int64) * bs + pos % bs

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g).to(self.dtype).to(device)

        k_cache, v_cache = rand(num_blocks, bs, kv_heads, dim), rand(num_blocks, bs, kv_heads, dim)
        qkv = rand(len(pos), self.num_heads + 2 * kv_heads, dim)
        q = qkv[:, : self.num_heads]
        k = qkv[:, self.num_heads : self.num_heads + kv_heads]
        v = qkv[:, self.num_heads + kv_heads :]

        def upload(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        scale = dim**-0.5
        dev = torch.device(device)
        reference = TorchAttention(bs, bs * kv_heads * dim, self.dtype, dev)
        caches = (k_cache.clone(), v_cache.clone())
        expected = reference.metadata(counts, context, tables, slots, upload).attend(
            q, k, v, *caches, scale
        )
        backend = TritonAttention(self.num_heads, kv_heads, dim, bs, dev, num_segments=segments)
        meta = backend.metadata(counts, context, tables, slots, upload)
        got_caches = (k_cache.clone(), v_cache.clone())
        got = meta.attend(q, k, v, *got_caches, scale)
        out_err = (got.float() - expected.float()).abs().max().item()
        cache_err = max(
            (a.float() - b.float()).abs().max().item()
            for a, b in zip(caches, got_caches, strict=True)
        )
        return out_err, cache_err


HEADS = [(4, 4), (4, 2), (6, 2), (8, 1), (9, 3)]  # (query heads, KV heads): MHA to MQA


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(
    seqs=st.lists(
        st.tuples(st.integers(0, 70), st.integers(1, 40)).map(
            lambda s: (s[0], 1) if s[1] > 30 else s  # about a quarter are decodes
        ),
        min_size=1,
        max_size=4,
    ),
    heads=st.sampled_from(HEADS),
    block_size=st.sampled_from([8, 16, 32]),
    segments=st.sampled_from([None, 1, 4]),
)
def test_mixed_batches_match_the_reference(
    seqs: list[tuple[int, int]],
    heads: tuple[int, int],
    block_size: int,
    segments: int | None,
) -> None:
    step = Step(seqs, heads[0], heads[1], block_size=block_size)
    out_err, cache_err = step.run(segments)
    assert cache_err == 0.0
    assert out_err < 1e-5


def test_head_dim_128_and_a_long_chunk_across_many_blocks() -> None:
    out_err, cache_err = Step([(150, 1), (37, 60), (0, 130)], 4, 2, head_dim=128).run()
    assert cache_err == 0.0 and out_err < 1e-5


@pytest.mark.parametrize("segments", [4, 16])
def test_split_kv_decodes_match(segments: int) -> None:
    """Segments that are empty (more segments than tiles) must not disturb the merge."""
    out_err, _ = Step([(300, 1), (5, 1), (129, 1)], 8, 2, block_size=16).run(segments)
    assert out_err < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_within_rounding(dtype: torch.dtype) -> None:
    out_err, cache_err = Step([(20, 1), (0, 25), (40, 9)], 6, 2, dtype=dtype).run()
    assert cache_err == 0.0
    assert out_err < 2e-2  # one rounding of outputs of magnitude about 1


def test_padding_rows_write_nothing_and_read_nothing() -> None:
    """A CUDA-graph batch pads with slot -1 and context 0: no write, zeros out, no NaN."""
    backend = TritonAttention(4, 2, 64, 16, torch.device("cpu"))
    counts = np.ones(3, np.int64)
    context = np.array([5, 0, 0])
    tables = np.array([[2, 0], [0, 0], [0, 0]], np.int32)
    slots = np.array([2 * 16 + 4, -1, -1])
    meta = backend.metadata(counts, context, tables, slots, torch.from_numpy)
    k_cache, v_cache = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
    q, k, v = torch.randn(3, 4, 64), torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    out = meta.attend(q, k, v, k_cache, v_cache, 0.125)
    assert torch.equal(k_cache[2, 4], k[0]) and torch.equal(v_cache[2, 4], v[0])
    assert int((k_cache != 0).sum()) == k[0].numel()
    assert torch.isfinite(out).all() and not out[1:].any()


def test_a_non_contiguous_key_is_refused() -> None:
    backend = TritonAttention(4, 2, 64, 16, torch.device("cpu"))
    k = torch.randn(64, 2, 3).transpose(0, 2)  # [3, 2, 64] with strides that split heads
    with pytest.raises(ValueError, match="contiguously"):
        backend.write_kv(k, k, torch.zeros(1), torch.zeros(1), torch.zeros(3, dtype=torch.long))
