"""The triton attention backend against dense references, under Triton's interpreter on CPU.

Each case builds one step of a mixed batch (prefills from scratch, prefill chunks after a
cached context, decodes) over a KV cache with scattered blocks, runs the backend on a copy of
the cache, and compares its output with a masked softmax over each sequence's gathered
context in float32 (sliding window and soft-cap included), and the written cache with the
expected one. The same cases run compiled on CUDA in `test_cuda.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trillm.gpu.attention._attention_triton import TritonAttention

pytestmark = pytest.mark.timeout(300)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first_pos: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One sequence's attention in float32: q [C, H, D] at positions first_pos.. over its
    whole context k, v [N, Hkv, D]; a key j is visible to the query at p when j <= p and,
    with a window, j > p - window (transformers' sliding_window_causal_mask_function)."""
    qpk = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)  # [H, C, D]
    kf = k.float().repeat_interleave(qpk, dim=1).transpose(0, 1)  # [H, N, D]
    vf = v.float().repeat_interleave(qpk, dim=1).transpose(0, 1)
    scores = qf @ kf.transpose(1, 2) * scale  # [H, C, N]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    p = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    j = torch.arange(k.shape[0])[None, :]
    visible = (j <= p) & ((j > p - window) if window > 0 else True)
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(0, 1)  # [C, H, D]


@dataclass
class Step:
    """One step's attention inputs; `seqs` is (tokens already cached, tokens this step).

    `poison_skipped` fills the cached keys and values of every tile wholly before a
    sequence's window with NaN in the backend's cache: a tile read, even masked, shows."""

    seqs: list[tuple[int, int]]
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    seed: int = 0
    window: int = 0
    softcap: float = 0.0
    poison_skipped: bool = False

    def run(self, segments: int | None = None, device: str = "cpu") -> tuple[float, float]:
        """Max |triton - dense| over the outputs, and over the caches after the KV write."""
        got, expected, got_caches, caches = self.outputs(segments, device)
        out_err = (got.float() - expected).abs().max().item()
        cache_err = max(
            # a poisoned key is NaN in both caches; a NaN in one of them only stays NaN
            torch.where(a.isnan() & b.isnan(), 0.0, a.float() - b.float()).abs().max().item()
            for a, b in zip(caches, got_caches, strict=True)
        )
        return out_err, cache_err

    def outputs(
        self, segments: int | None = None, device: str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """The backend's output and the dense one [T, H, D], then both caches (K, V)."""
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
        backend = TritonAttention(self.num_heads, kv_heads, dim, bs, dev, num_segments=segments)
        caches = (k_cache.clone(), v_cache.clone())
        got_caches = (k_cache.clone(), v_cache.clone())
        slots_t = torch.from_numpy(slots).to(dev)
        for cache, new in zip(caches, (k, v), strict=True):
            cache.view(-1, kv_heads, dim)[slots_t] = new
        expected = torch.empty(q.shape, dtype=torch.float32, device=dev)
        for i, ((cached, _), n, first) in enumerate(
            zip(self.seqs, context, np.cumsum(counts) - counts, strict=True)
        ):
            ctx = torch.from_numpy(tables[i, np.arange(n) // bs] * bs + np.arange(n) % bs)
            ctx = ctx.to(dev)
            k_ctx, v_ctx = (c.view(-1, kv_heads, dim)[ctx] for c in caches)
            span = slice(int(first), int(first + n - cached))
            expected[span] = dense_attention(
                q[span], k_ctx, v_ctx, cached, scale, self.window, self.softcap
            )
            if self.poison_skipped and self.window > 0:
                skipped = max(0, cached - self.window + 1) // backend.tile * backend.tile
                for c in (*caches, *got_caches):
                    c.view(-1, kv_heads, dim)[ctx[:skipped]] = float("nan")
        meta = backend.metadata(counts, context, tables, slots, upload)
        got = meta.attend(q, k, v, *got_caches, scale, self.window, self.softcap)
        return got, expected, got_caches, caches


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
@pytest.mark.slow
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


# -- sliding windows and soft-capping --------------------------------------------------------

# Decodes, prefill chunks after a cached context (one across a 128-key interpreter tile) and a
# prompt from scratch, in one batch; contexts up to 291 keys span three tiles.
MIXED = [(290, 1), (5, 1), (200, 30), (0, 40), (60, 17)]


@pytest.mark.parametrize(
    "window",
    [1, 5, 16, 40, 1000],
    ids=["itself-only", "under-a-block", "one-block", "three-blocks", "past-the-context"],
)
def test_sliding_windows_match_the_dense_reference(window: int) -> None:
    """Keys in tiles wholly before a window are NaN in the cache: the kernel must skip them.
    A chunk whose first window starts at key 127, the last of tile 0, must not skip tile 0;
    a decode whose window starts at key 128 must skip it."""
    edge = [(126 + window, 9), (127 + window, 1)] if window < 100 else []
    step = Step(MIXED + edge, 6, 2, block_size=16, window=window, poison_skipped=True)
    out_err, cache_err = step.run()
    assert cache_err == 0.0
    assert out_err < 1e-5


@pytest.mark.parametrize("window", [0, 40], ids=["softcap-alone", "softcap-and-window"])
def test_softcapped_scores_match_the_dense_reference(window: int) -> None:
    """A cap of 1.5 bends scores of magnitude about 1 (head_dim 64, unit-normal q and k)."""
    step = Step(MIXED, 4, 2, block_size=16, window=window, softcap=1.5, poison_skipped=True)
    out_err, cache_err = step.run()
    assert cache_err == 0.0
    assert out_err < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(("segments", "softcap"), [(2, 0.0), (16, 2.0)])
def test_split_kv_segments_split_only_the_window(segments: int, softcap: float) -> None:
    """A 400-key window over 701 keys is tiles 2..5 of 128: two segments take two tiles each
    from tile 2; sixteen leave most segments empty. Over 655 keys it starts at key 255, the
    last of tile 1. Skipped tiles are NaN in the cache."""
    seqs = [(700, 1), (654, 1), (300, 1), (5, 1), (129, 1)]
    step = Step(seqs, 8, 2, window=400, softcap=softcap, poison_skipped=True)
    out_err, cache_err = step.run(segments)
    assert cache_err == 0.0
    assert out_err < 1e-5


def test_a_window_past_the_context_changes_nothing_bit_for_bit() -> None:
    full = Step(MIXED, 6, 2).outputs()[0]
    windowed = Step(MIXED, 6, 2, window=1000).outputs()[0]
    assert torch.equal(full, windowed)


@pytest.mark.slow
@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(
    seqs=st.lists(
        st.tuples(st.integers(0, 300), st.integers(1, 40)).map(
            lambda s: (s[0], 1) if s[1] > 30 else s
        ),
        min_size=1,
        max_size=3,
    ),
    heads=st.sampled_from(HEADS),
    block_size=st.sampled_from([8, 16, 32]),
    window=st.sampled_from([1, 3, 8, 16, 17, 50, 130]),
    softcap=st.sampled_from([0.0, 0.0, 2.0]),
    segments=st.sampled_from([None, 4]),
)
def test_random_windows_and_caps_match_the_reference(
    seqs: list[tuple[int, int]],
    heads: tuple[int, int],
    block_size: int,
    window: int,
    softcap: float,
    segments: int | None,
) -> None:
    step = Step(seqs, *heads, block_size=block_size, window=window, softcap=softcap)
    out_err, cache_err = step.run(segments)
    assert cache_err == 0.0
    assert out_err < 1e-5


@pytest.mark.parametrize(
    ("window", "softcap", "message"),
    [(-1, 0.0, r"window must be >= 0 keys \(0: no window\), got -1"),
     (0, -0.5, r"softcap must be >= 0 \(0: no cap\), got -0.5")],
)  # fmt: skip
def test_a_negative_window_or_softcap_is_refused(window: int, softcap: float, message: str) -> None:
    backend = TritonAttention(4, 2, 64, 16, torch.device("cpu"))
    meta = backend.metadata(np.ones(1), np.ones(1), np.zeros((1, 1), np.int32), np.zeros(1),
                            torch.from_numpy)  # fmt: skip
    q, kv = torch.randn(1, 4, 64), torch.randn(1, 2, 64)
    with pytest.raises(ValueError, match=message):
        meta.attend(q, kv, kv, torch.zeros(1, 16, 2, 64), torch.zeros(1, 16, 2, 64), 0.125,
                    window, softcap)  # fmt: skip


# -- the KV write's 2-D grid -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv_heads", "head_dim", "dtype"),
    [(20, 128, torch.bfloat16), (12, 80, torch.float32), (3, 64, torch.float16)],
    ids=["2560-wide-bf16", "960-wide-head-80", "192-wide"],
)
def test_a_wide_kv_write_over_column_blocks_equals_the_torch_scatter(
    kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """Rows of Hkv * D columns (non-power-of-two Hkv, several column blocks with a partial
    last one under the interpreter's 1024) of 300 tokens (three token blocks, the last
    partial), read from q/k/v views of one qkv, with padding slots: the cache equals torch's
    scatter of the same rows, and nothing else is written."""
    g = torch.Generator().manual_seed(7)
    tokens, heads, block_size, num_blocks = 300, 2 * kv_heads, 16, 24
    backend = TritonAttention(heads, kv_heads, head_dim, block_size, torch.device("cpu"))
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    k, v = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[torch.randperm(tokens, generator=g)[:37]] = -1  # padding rows write nothing
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    real = slots >= 0
    expected_k.view(-1, kv_heads, head_dim)[slots[real]] = k[real]
    expected_v.view(-1, kv_heads, head_dim)[slots[real]] = v[real]
    backend.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_a_wide_multi_head_step_matches_the_reference() -> None:
    """The whole step (write, then attention over the written cache) at Hkv * D = 2560."""
    out_err, cache_err = Step([(20, 1), (0, 9)], 20, 20, head_dim=128).run()
    assert cache_err == 0.0
    assert out_err < 1e-4
