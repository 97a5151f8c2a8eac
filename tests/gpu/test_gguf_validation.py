"""A GGUF file's sizes are checked when it is read: a head count of 0 or a context of 2**40
fails with a GGUFError naming the key and the value, never a ZeroDivisionError or a huge
allocation later. Each case writes a tiny metadata-only file with gguf's writer."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from trillm.gpu.loader._gguf import GGUFCheckpoint, GGUFError

VOCAB, HIDDEN = 32, 16
SIZES: dict[str, Any] = {  # a valid tiny llama: 4 heads of 4, 2 key/value heads
    "block_count": 2,
    "context_length": 64,
    "embedding_length": HIDDEN,
    "feed_forward_length": 32,
    "attention.head_count": 4,
    "attention.head_count_kv": 2,
    "attention.layer_norm_rms_epsilon": 1e-5,
    "rope.freq_base": 10000.0,
    "vocab_size": VOCAB,
}
EXPERTS = {"expert_count": 2, "expert_used_count": 1, "expert_feed_forward_length": 8}


class I32(int):
    """Written as a signed 32-bit value."""


class U64(int):
    """Written as an unsigned 64-bit value."""


def write_gguf(path: Path, arch: str = "llama", *, experts: bool = False, **keys: Any) -> Path:
    """`path`, a GGUF of `arch` with `SIZES` updated by `keys` (None removes one) and one
    tensor, the embedding (plus a layer's expert tensor with `experts`)."""
    writer = gguf.GGUFWriter(path, arch)
    for key, value in {**SIZES, **(EXPERTS if experts else {}), **keys}.items():
        name = f"{arch}.{key}"
        if value is None:
            continue
        if isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, I32):
            writer.add_int32(name, value)
        elif isinstance(value, U64):
            writer.add_uint64(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        else:
            writer.add_string(name, value)
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN), dtype=np.float32))
    if experts:
        writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 8, HIDDEN), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_valid_file_reads(tmp_path: Path) -> None:
    with GGUFCheckpoint.open(write_gguf(tmp_path / "tiny.gguf")) as checkpoint:
        config = checkpoint.config
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert (config["head_dim"], config["max_position_embeddings"]) == (4, 64)


def whole(key: str, value: object, limit: int, at_least: int = 1) -> str:
    return (
        f"metadata '{key}' is {value!r}; it must be a whole number in {at_least}..{limit}, "
        "so the file is damaged or not a model"
    )


def positive(key: str, value: object) -> str:
    return (
        f"metadata '{key}' is {value!r}; it must be a finite number above 0, so the file is "
        "damaged or not a model"
    )


BAD = {
    "head_count-0": (
        {"attention.head_count": 0}, whole("llama.attention.head_count", 0, 4096)),
    "head_count-negative": (
        {"attention.head_count": I32(-4)}, whole("llama.attention.head_count", -4, 4096)),
    "head_count-huge": (
        {"attention.head_count": 1 << 13}, whole("llama.attention.head_count", 8192, 4096)),
    "head_count-a-string": (
        {"attention.head_count": "4"}, whole("llama.attention.head_count", "4", 4096)),
    "head_count-a-float": (
        {"attention.head_count": 4.0}, whole("llama.attention.head_count", 4.0, 4096)),
    "head_count-a-bool": (
        {"attention.head_count": True}, whole("llama.attention.head_count", True, 4096)),
    "head_count_kv-0": (
        {"attention.head_count_kv": 0}, whole("llama.attention.head_count_kv", 0, 4)),
    "head_count_kv-above-heads": (
        {"attention.head_count_kv": 8}, whole("llama.attention.head_count_kv", 8, 4)),
    "head_count_kv-not-dividing": (
        {"attention.head_count_kv": 3},
        "metadata 'llama.attention.head_count_kv' is 3, which does not divide "
        "'llama.attention.head_count' 4: every key/value head serves the same number of query "
        "heads, so the file is damaged"),
    "hidden-not-a-multiple-of-heads": (
        {"embedding_length": 18},
        "metadata 'llama.embedding_length' 18 is not a multiple of 'llama.attention.head_count' "
        "4, and no 'llama.attention.key_length' says the head size"),
    "key_length-0": (
        {"attention.key_length": 0}, whole("llama.attention.key_length", 0, 16384)),
    "embedding_length-0": (
        {"embedding_length": 0}, whole("llama.embedding_length", 0, 1 << 20)),
    "embedding_length-huge": (
        {"embedding_length": 1 << 21}, whole("llama.embedding_length", 1 << 21, 1 << 20)),
    "feed_forward_length-0": (
        {"feed_forward_length": 0}, whole("llama.feed_forward_length", 0, 1 << 20)),
    "context_length-0": (
        {"context_length": 0}, whole("llama.context_length", 0, 1 << 20)),
    "context_length-2**40": (
        {"context_length": U64(1 << 40)}, whole("llama.context_length", 1 << 40, 1 << 20)),
    "block_count-0": ({"block_count": 0}, whole("llama.block_count", 0, 4096)),
    "block_count-a-million": (
        {"block_count": 10**6}, whole("llama.block_count", 10**6, 4096)),
    "vocab_size-0": ({"vocab_size": 0}, whole("llama.vocab_size", 0, 1 << 24)),
    "rope-dims-odd": (
        {"rope.dimension_count": 3},
        "metadata 'llama.rope.dimension_count' is 3; rotary embeddings turn pairs of dims, so "
        "it must be even"),
    "rope-dims-above-head": (
        {"rope.dimension_count": 8}, whole("llama.rope.dimension_count", 8, 4)),
    "rms-eps-0": (
        {"attention.layer_norm_rms_epsilon": 0.0},
        positive("llama.attention.layer_norm_rms_epsilon", 0.0)),
    "rms-eps-nan": (
        {"attention.layer_norm_rms_epsilon": math.nan},
        positive("llama.attention.layer_norm_rms_epsilon", math.nan)),
    "rope-base-negative": (
        {"rope.freq_base": -1.0}, positive("llama.rope.freq_base", -1.0)),
    "context_length-missing": (
        {"context_length": None},
        "metadata key 'llama.context_length' is missing; the file is incomplete"),
}  # fmt: skip


@pytest.mark.parametrize(("keys", "message"), BAD.values(), ids=BAD.keys())
def test_a_size_out_of_range_is_named_with_its_value(
    tmp_path: Path, keys: dict[str, Any], message: str
) -> None:
    path = write_gguf(tmp_path / "bad.gguf", **keys)
    with pytest.raises(GGUFError, match=f"^{re.escape(f'{path}: {message}')}$"):
        GGUFCheckpoint.open(path)


EXPERT_CASES = {
    "mixtral-expert_count-0": (
        "llama", {"expert_count": 0}, whole("llama.expert_count", 0, 4096)),
    "mixtral-used-above-experts": (
        "llama", {"expert_used_count": 3}, whole("llama.expert_used_count", 3, 2)),
    "mixtral-used-0": (
        "llama", {"expert_used_count": 0}, whole("llama.expert_used_count", 0, 2)),
    "qwen3moe-expert-ffn-0": (
        "qwen3moe", {"expert_feed_forward_length": 0},
        whole("qwen3moe.expert_feed_forward_length", 0, 1 << 20)),
}  # fmt: skip


@pytest.mark.parametrize(("arch", "keys", "message"), EXPERT_CASES.values(), ids=EXPERT_CASES)
def test_expert_counts_are_checked(
    tmp_path: Path, arch: str, keys: dict[str, Any], message: str
) -> None:
    path = write_gguf(tmp_path / "moe.gguf", arch, experts=True, **keys)
    with pytest.raises(GGUFError, match=f"^{re.escape(f'{path}: {message}')}$"):
        GGUFCheckpoint.open(path)
