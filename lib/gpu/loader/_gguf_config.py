"""GGUF metadata translated into the `config.json` transformers 5 writes, family by family.

What llama.cpp's converter (`convert_hf_to_gguf.py`) keeps of a config is whatever its model
class writes; what it drops, llama.cpp hard-codes, and so do we, to run the model llama.cpp
would: Gemma's attention scale from the head size (and the 27B's exception), Gemma 2's and 3's
sliding-window pattern, SmolLM3's rope-less every 4th layer, Qwen3-MoE's renormalised top-k,
Granite's default attention scale. Each family function takes the fields every family shares
(`base_config`) and adds, renames or drops its own.
"""

from __future__ import annotations

from typing import Any

from ._gguf_metadata import (
    MAX_COUNT,
    MAX_HEAD_DIM,
    MAX_LENGTH,
    MAX_VOCAB,
    GGUFError,
    Metadata,
    float32,
)

Config = dict[str, Any]


def base_config(
    meta: Metadata, model_type: str, hf_class: str, *, partial_rotary: bool = False
) -> Config:
    """The fields every family has, from `{arch}.*` keys llama.cpp's `TextModel` writes.

    Raises:
        GGUFError: a required key is missing, a size is out of range (`heads`), or the rotary
            embedding covers part of each head in a family whose Hugging Face config cannot
            say so.
    """
    hidden = meta.count("embedding_length", MAX_LENGTH)
    n_head, n_kv_head, head_dim = heads(meta, hidden)
    rotary_dim = meta.count("rope.dimension_count", head_dim, default=head_dim)
    if rotary_dim % 2:
        raise GGUFError(
            f"{meta.path}: metadata '{meta.arch}.rope.dimension_count' is {rotary_dim}; rotary "
            "embeddings turn pairs of dims, so it must be even"
        )
    if rotary_dim != head_dim and not partial_rotary:
        raise GGUFError(
            f"{meta.path}: partial rotary embeddings ({rotary_dim} of {head_dim} dims per head) "
            f"are not supported for {model_type}"
        )
    config: Config = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": meta.count("vocab_size", MAX_VOCAB, default=meta.rows("token_embd.weight")),
        "hidden_size": hidden,
        "intermediate_size": meta.count("feed_forward_length", MAX_LENGTH),
        "num_hidden_layers": meta.count("block_count", MAX_COUNT),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv_head,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": meta.positive("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": meta.count("context_length", MAX_LENGTH),
        "rope_parameters": rope_parameters(meta),
        "tie_word_embeddings": not meta.has("output.weight"),
        "bos_token_id": meta.general("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.general("tokenizer.ggml.eos_token_id"),
        "dtype": "float32",
    }
    pad = meta.general("tokenizer.ggml.padding_token_id")
    if pad is not None:
        config["pad_token_id"] = pad
    return config


def heads(meta: Metadata, hidden: int) -> tuple[int, int, int]:
    """The query heads, key/value heads and head size, checked against each other.

    Raises:
        GGUFError: a count of 0 or above the cap, key/value heads that do not divide the
            query heads, or no `attention.key_length` and a hidden size that is not a multiple
            of the heads.
    """
    n_head = meta.count("attention.head_count", MAX_COUNT)
    n_kv_head = meta.count("attention.head_count_kv", n_head, default=n_head)
    if n_head % n_kv_head:
        raise GGUFError(
            f"{meta.path}: metadata '{meta.arch}.attention.head_count_kv' is {n_kv_head}, which "
            f"does not divide '{meta.arch}.attention.head_count' {n_head}: every key/value head "
            "serves the same number of query heads, so the file is damaged"
        )
    if meta.get("attention.key_length") is None and hidden % n_head:
        raise GGUFError(
            f"{meta.path}: metadata '{meta.arch}.embedding_length' {hidden} is not a multiple "
            f"of '{meta.arch}.attention.head_count' {n_head}, and no "
            f"'{meta.arch}.attention.key_length' says the head size"
        )
    head_dim = meta.count("attention.key_length", MAX_HEAD_DIM, default=hidden // n_head)
    return n_head, n_kv_head, head_dim


def rope_parameters(meta: Metadata, default_theta: float = 10000.0) -> Config:
    """`rope_parameters` from `{arch}.rope.freq_base` and `{arch}.rope.scaling.*`.

    Raises:
        GGUFError: a scaling type the converter cannot carry whole (longrope outside Phi-3).
    """
    rope: Config = {"rope_theta": meta.positive("rope.freq_base", default_theta)}
    kind = meta.get("rope.scaling.type")
    factor = meta.get("rope.scaling.factor")
    if kind is None and meta.get("rope.scale_linear") is not None:
        kind, factor = "linear", meta.get("rope.scale_linear")  # pre-2024 files
    if kind in (None, "none") or factor in (None, 1.0):
        return {**rope, "rope_type": "default"}
    if kind == "linear":
        return {**rope, "rope_type": "linear", "factor": float32(factor)}
    if kind == "yarn":
        original = meta.get("rope.scaling.original_context_length")
        if original is None:
            raise GGUFError(
                f"{meta.path}: yarn rope scaling without "
                f"'{meta.arch}.rope.scaling.original_context_length'"
            )
        rope.update(rope_type="yarn", factor=float32(factor))
        rope["original_max_position_embeddings"] = meta.count(
            "rope.scaling.original_context_length", MAX_LENGTH
        )
        for ours, theirs in (
            ("yarn_beta_fast", "beta_fast"),
            ("yarn_beta_slow", "beta_slow"),
            ("yarn_attn_factor", "attention_factor"),
        ):
            if (value := meta.get(f"rope.scaling.{ours}")) is not None:
                rope[theirs] = float32(value)
        return rope
    raise GGUFError(f"{meta.path}: rope scaling type {kind!r} is not supported (linear, yarn are)")


def _biases(meta: Metadata, config: Config, *, mlp: bool = True) -> Config:
    config["attention_bias"] = meta.has("blk.0.attn_q.bias")
    if mlp:
        config["mlp_bias"] = meta.has("blk.0.ffn_up.bias")
    return config


def llama(meta: Metadata, config: Config) -> Config:
    return _biases(meta, config)


def mixtral(meta: Metadata, config: Config) -> Config:
    """Mixtral is llama.cpp's `llama` with experts: `llama.expert_count` and friends."""
    config["num_local_experts"], config["num_experts_per_tok"] = experts(meta)
    return config


def experts(meta: Metadata) -> tuple[int, int]:
    """The experts per MoE layer and those each token uses (1..the experts)."""
    num_experts = meta.count("expert_count", MAX_COUNT)
    return num_experts, meta.count("expert_used_count", num_experts)


def qwen2(meta: Metadata, config: Config) -> Config:
    return config  # q, k and v always have biases; the config has no switch


def qwen3(meta: Metadata, config: Config) -> Config:
    return _biases(meta, config, mlp=False)


def qwen3_moe(meta: Metadata, config: Config) -> Config:
    """Every layer is MoE (the converter maps no dense `mlp.*_proj` for qwen3moe), and llama.cpp
    renormalises the top-k router weights unless `expert_weights_norm` says otherwise."""
    num_experts, config["num_experts_per_tok"] = experts(meta)
    config.update(num_experts=num_experts, num_local_experts=num_experts)
    config["moe_intermediate_size"] = meta.count("expert_feed_forward_length", MAX_LENGTH)
    config["norm_topk_prob"] = bool(meta.get("expert_weights_norm", True))
    config.update(decoder_sparse_step=1, mlp_only_layers=[])
    return _biases(meta, config, mlp=False)


def _gemma(meta: Metadata, config: Config, *, layers_27b: int, swa_period: int) -> Config:
    """What Gemma 2 and 3 share: GeGLU, llama.cpp's attention scale, the sliding pattern."""
    del config["hidden_act"]
    config["hidden_activation"] = "gelu_pytorch_tanh"
    _biases(meta, config, mlp=False)
    # llama.cpp scales queries by 1/sqrt(head_dim), but by 1/sqrt(hidden/heads) for the 27B
    # models, which it knows by their layer count; an explicit attention.scale wins.
    if (scale := meta.get("attention.scale")) is not None:
        scalar = float(scale) ** -2  # stored as float32: round back to the integer it was
        config["query_pre_attn_scalar"] = (
            round(scalar) if abs(scalar - round(scalar)) < 1e-3 else scalar
        )
    elif config["num_hidden_layers"] == layers_27b:
        config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"]
    else:
        config["query_pre_attn_scalar"] = config["head_dim"]
    layers = config["num_hidden_layers"]
    pattern = meta.general(f"{meta.arch}.attention.sliding_window_pattern", swa_period)
    if isinstance(pattern, list):
        sliding = [bool(s) for s in pattern]
    else:  # llama.cpp's set_swa_pattern(n): every n-th layer attends to everything
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
    if len(sliding) != layers:
        raise GGUFError(
            f"{meta.path}: '{meta.arch}.attention.sliding_window_pattern' has {len(sliding)} "
            f"entries for {layers} layers; the file is damaged"
        )
    config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    return config


def gemma2(meta: Metadata, config: Config) -> Config:
    """llama.cpp's defaults where the keys are absent: a 4096 window, caps of 50 and 30."""
    _gemma(meta, config, layers_27b=46, swa_period=2)
    config["sliding_window"] = meta.count("attention.sliding_window", MAX_LENGTH, default=4096)
    config["attn_logit_softcapping"] = float32(meta.get("attn_logit_softcapping", 50.0))
    config["final_logit_softcapping"] = float32(meta.get("final_logit_softcapping", 30.0))
    return config


def gemma3(meta: Metadata, config: Config) -> Config:
    """Gemma 3's global layers take `rope.freq_base` and the scaling; its local ones a base of
    10000 (llama.cpp's constant, or `rope.freq_base_swa`) and none. No window: none slides."""
    _gemma(meta, config, layers_27b=62, swa_period=6)
    window = meta.count("attention.sliding_window", MAX_LENGTH, default=0, at_least=0)
    config["sliding_window"] = window or None
    if not window:
        config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    config["attn_logit_softcapping"] = None
    cap = meta.get("final_logit_softcapping")
    config["final_logit_softcapping"] = float32(cap) if cap else None
    local = meta.positive("rope.freq_base_swa", 10000.0)
    config["rope_parameters"] = {
        "full_attention": rope_parameters(meta, default_theta=1_000_000.0),
        "sliding_attention": {"rope_theta": local, "rope_type": "default"},
    }
    return config


def phi3(meta: Metadata, config: Config) -> Config:
    """Phi-3's converter writes no `head_dim`, no scaling type and a window of 0 for none;
    longrope's factors are the tensors `rope_factors_long/short.weight`."""
    head_dim = config.pop("head_dim")
    rotary_dim = int(meta.get("rope.dimension_count", head_dim))
    factor = rotary_dim / head_dim
    original = meta.count("rope.scaling.original_context_length", MAX_LENGTH, default=0, at_least=0)
    window = meta.count("attention.sliding_window", MAX_LENGTH, default=0, at_least=0)
    config.update(partial_rotary_factor=factor, sliding_window=window or None)
    config["original_max_position_embeddings"] = original or config["max_position_embeddings"]
    rope: Config = {
        "rope_theta": config["rope_parameters"]["rope_theta"],
        "rope_type": "default",
        "partial_rotary_factor": factor,
    }
    long, short = "rope_factors_long.weight", "rope_factors_short.weight"
    if meta.has(long) or meta.has(short):
        rope.update(rope_type="longrope", long_factor=meta.floats(long))
        rope["short_factor"] = meta.floats(short)
        rope["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        for kind in ("long_factor", "short_factor"):
            if len(rope[kind]) != rotary_dim // 2:
                raise GGUFError(
                    f"{meta.path}: {len(rope[kind])} longrope {kind}s for {rotary_dim} rotary "
                    f"dims; there must be {rotary_dim // 2}"
                )
    config["rope_parameters"] = rope
    return config


def olmo2(meta: Metadata, config: Config) -> Config:
    """OLMo 3 shares llama.cpp's `olmo2` name; only its sliding windows tell it apart."""
    if meta.get("attention.sliding_window") is not None:
        raise GGUFError(
            f"{meta.path}: an olmo2 file with sliding-window attention is OLMo 3, which is not "
            "supported; only OLMo 2 is"
        )
    return _biases(meta, config, mlp=False)


def granite(meta: Metadata, config: Config) -> Config:
    """Granite's multipliers are llama.cpp's `*_scale` keys, written only when non-zero; an
    absent attention scale is llama.cpp's 1/sqrt(head_dim)."""
    head_dim = config.pop("head_dim")
    if head_dim != config["hidden_size"] // config["num_attention_heads"]:
        raise GGUFError(
            f"{meta.path}: a granite head of {head_dim} dims, not hidden/heads; Granite's "
            "config cannot express it"
        )
    config["embedding_multiplier"] = float32(meta.get("embedding_scale", 1.0))
    config["residual_multiplier"] = float32(meta.get("residual_scale", 1.0))
    config["logits_scaling"] = float32(meta.get("logit_scale", 1.0))
    scale = meta.get("attention.scale")
    config["attention_multiplier"] = float32(scale) if scale else head_dim**-0.5
    return _biases(meta, config)


def smollm3(meta: Metadata, config: Config) -> Config:
    """No GGUF key says which layers skip rope: llama.cpp hard-codes every 4th."""
    layers = config["num_hidden_layers"]
    config["no_rope_layer_interval"] = 4
    config["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(layers)]
    config.update(use_sliding_window=False, sliding_window=None)
    return _biases(meta, config)
