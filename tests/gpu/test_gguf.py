"""GGUF reading: our dequantisers against gguf's reference, and a Llama round trip through GGUF."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers

from trillm.default_model import DefaultModelMissingError, find_default_gguf
from trillm.gpu.loader._gguf import GGUFCheckpoint, GGUFError, dequantize

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def smollm2_reader() -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(find_default_gguf())
    except DefaultModelMissingError as exc:
        pytest.skip(str(exc))


def torch_shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(dim) for dim in reversed(tensor.shape.tolist()))


def test_real_tensors_equal_reference(smollm2_reader: gguf.GGUFReader) -> None:
    by_type: dict[Q, list[Any]] = {}
    for tensor in smollm2_reader.tensors:
        by_type.setdefault(tensor.tensor_type, []).append(tensor)
    assert set(by_type) == {Q.F32, Q.Q8_0, Q.Q4_1}
    for tensors in by_type.values():
        for tensor in tensors[:4]:  # embedding (Q8_0), block 0's norms and projections
            ours = dequantize(tensor.data, tensor.tensor_type, torch_shape(tensor))
            reference = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            assert ours.dtype == torch.float32
            assert tuple(ours.shape) == reference.shape
            assert np.array_equal(ours.numpy(), reference), tensor.name


SYNTHETIC_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0]  # Q5_0: the fallback


@pytest.mark.parametrize("qtype", SYNTHETIC_TYPES, ids=lambda q: q.name)
def test_synthetic_blocks_equal_reference(qtype: Q) -> None:
    rng = np.random.default_rng(0)
    data = rng.standard_normal((6, 96)).astype(np.float32) * 3
    data[0, :32] = 0.0  # an all-zero block (scale 0)
    data[1, :32] = 7.5  # a constant block (Q4_1: range 0)
    data[2, 5] = -40.0  # an outlier that sets the block's scale
    raw = gguf.quants.quantize(data, qtype)
    ours = dequantize(raw, qtype, data.shape)
    reference = gguf.quants.dequantize(raw, qtype).reshape(data.shape)
    assert ours.shape == data.shape
    assert np.array_equal(ours.numpy(), reference)
    # And the bytes of the same tensor, as GGUFReader hands over non-float types, agree too.
    assert torch.equal(dequantize(raw.view(np.uint8), qtype, data.shape), ours)


def test_block_layout_by_hand() -> None:
    """Independent of gguf: low nibble j is weight j, high nibble j is weight j + 16."""
    q = np.arange(32, dtype=np.uint8) % 16
    nibbles = q[:16] | (q[16:] << 4)
    d, m = np.float16(0.5).tobytes(), np.float16(-1.0).tobytes()
    q4_0 = np.frombuffer(d + nibbles.tobytes(), dtype=np.uint8)
    q4_1 = np.frombuffer(d + m + nibbles.tobytes(), dtype=np.uint8)
    q8_0 = np.frombuffer(d + (q.astype(np.int8) - 8).tobytes(), dtype=np.uint8)
    expected = torch.tensor(q, dtype=torch.float32)
    assert torch.equal(dequantize(q4_0, Q.Q4_0, (32,)), 0.5 * (expected - 8))
    assert torch.equal(dequantize(q4_1, Q.Q4_1, (32,)), 0.5 * expected - 1)
    assert torch.equal(dequantize(q8_0, Q.Q8_0, (1, 32)), 0.5 * (expected - 8)[None])


def test_wrong_byte_count() -> None:
    raw = np.zeros(33, dtype=np.uint8)
    message = (
        "Q8_0 data of 33 bytes cannot hold a tensor of shape (32,): expected 34 bytes; "
        "the file is truncated or its tensor info is wrong"
    )
    with pytest.raises(GGUFError, match=re.escape(message)):
        dequantize(raw, Q.Q8_0, (32,))


# A round trip: a random Hugging Face Llama -> GGUF as llama.cpp writes it -> GGUFCheckpoint.

VOCAB = 256
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
)
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """`LlamaModel.permute` from llama.cpp's convert_hf_to_gguf.py (n_head is kv heads for K)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf: str) -> str:
    if hf in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    part, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[part]}.{suffix}"


def write_llama_gguf(
    path: Path,
    model: transformers.LlamaForCausalLM,
    *,
    q8_0: str | None = None,
    arch: str = "llama",
    extra_tensor: str | None = None,
    types: dict[str, Q] | None = None,
) -> None:
    """Write `model` as llama.cpp's converter would; `q8_0` names a weight stored as Q8_0,
    `types` maps weight names to other GGML types (the rest are F32)."""
    types = {**(types or {}), **({q8_0: Q.Q8_0} if q8_0 is not None else {})}
    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if config.rope_parameters["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_parameters["factor"])
    state = model.state_dict()
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    for name, tensor in state.items():
        w = tensor.numpy()
        if ".q_proj." in name:
            w = llama_cpp_permute(w, config.num_attention_heads)
        elif ".k_proj." in name:
            w = llama_cpp_permute(w, config.num_key_value_heads)
        if name in types:
            qtype = types[name]
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(w))
    if extra_tensor is not None:
        writer.add_tensor(extra_tensor, np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_llama(**overrides: Any) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides}))
    with torch.no_grad():  # random norms and biases, so a misplaced one shows in the logits
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.normal_(1.0 if "norm" in name else 0.0, 0.5)
    return model.eval()


@pytest.mark.parametrize(
    "overrides, q8_0",
    [
        (dict(tie_word_embeddings=False), "model.layers.1.self_attn.k_proj.weight"),
        (dict(tie_word_embeddings=True, attention_bias=True), None),
        (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "model.embed_tokens.weight"),
    ],
    ids=["untied-q8_0", "tied-bias", "linear-rope"],
)
def test_llama_round_trip_logits(
    tmp_path: Path, overrides: dict[str, Any], q8_0: str | None
) -> None:
    model = tiny_llama(**overrides)
    if q8_0 is not None:  # the original takes the values the Q8_0 tensor will hold
        param = model.get_parameter(q8_0)
        with torch.no_grad():
            quantised = gguf.quants.quantize(param.numpy(), Q.Q8_0)
            param.copy_(torch.from_numpy(gguf.quants.dequantize(quantised, Q.Q8_0)))
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, model, q8_0=q8_0)

    with GGUFCheckpoint.open(path) as checkpoint:
        config = checkpoint.config
        state = dict(checkpoint.tensors())
    for key in ("hidden_size", "num_key_value_heads", "vocab_size", "tie_word_embeddings"):
        assert config[key] == getattr(model.config, key)
    assert config["attention_bias"] == model.config.attention_bias
    assert ("lm_head.weight" in state) == (not model.config.tie_word_embeddings)
    assert all(t.dtype == torch.float32 for t in state.values())

    loaded = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    assert loaded.config.rope_parameters == model.config.rope_parameters
    missing, unexpected = loaded.load_state_dict(state, strict=False)
    assert unexpected == []
    assert missing == (["lm_head.weight"] if config["tie_word_embeddings"] else [])
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.gguf"
    with pytest.raises(GGUFError, match=re.escape(f"{path}: no such GGUF file; check the path")):
        GGUFCheckpoint.open(path)


def test_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 8)
    with pytest.raises(GGUFError, match=re.escape(f"{path}: not a readable GGUF file (")):
        GGUFCheckpoint.open(path)


def test_not_llama(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    write_llama_gguf(path, tiny_llama(), arch="gpt2")
    message = (
        f"{path}: architecture 'gpt2' is not supported; trillm loads GGUF files of the "
        "architectures llama, qwen2, qwen3, gemma2, gemma3, phi3, olmo2, granite, smollm3, qwen3moe"
    )
    with pytest.raises(GGUFError, match=re.escape(message)):
        GGUFCheckpoint.open(path)


def test_unknown_tensor(tmp_path: Path) -> None:
    path = tmp_path / "rope-freqs.gguf"
    write_llama_gguf(path, tiny_llama(), extra_tensor="rope_freqs.weight")
    message = (
        f"{path}: tensor 'rope_freqs.weight' has no Hugging Face Llama counterpart "
        "(1 such tensors); this GGUF variant is not supported"
    )
    with pytest.raises(GGUFError, match=re.escape(message)):
        GGUFCheckpoint.open(path)
