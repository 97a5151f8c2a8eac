"""Every GGUF architecture trillm loads, round-tripped: a tiny random Hugging Face checkpoint ->
GGUF as llama.cpp's `convert_hf_to_gguf.py` writes it -> `GGUFCheckpoint` -> the same checkpoint.

The writer here is the oracle, and it follows the converter, not our loader: each step names
the converter class it mirrors (`TextModel.set_gguf_parameters`, `LlamaModel.permute`,
`Gemma2Model.modify_tensors`, ...), and tensor names go through the `gguf` package's own
`get_tensor_name_map`, the map the converter uses.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from trillm.gpu.loader import _gguf_arch
from trillm.gpu.loader._gguf import GGUFCheckpoint, GGUFError
from trillm.gpu.models import FAMILIES, family_for
from trillm.gpu.quant._gguf_blocks import QuantizedTensor

from .conftest import make_runner
from .driver import Driver, DriverRequest
from .test_model_runner import CapturingSampler

Q = gguf.GGMLQuantizationType
A = gguf.MODEL_ARCH
TINY: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# The fields every family's config must carry, and equal to the checkpoint's config.json.
COMMON_KEYS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_parameters",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


@dataclass(frozen=True)
class Case:
    """One family: its tiny Hugging Face config and how the converter writes it."""

    id: str
    arch: gguf.MODEL_ARCH
    hf_config: Callable[[], transformers.PretrainedConfig]
    metadata: Callable[[gguf.GGUFWriter, dict[str, Any]], None]  # set_gguf_parameters
    keys: tuple[str, ...] = ()  # config fields beyond COMMON_KEYS
    permutes_qk: bool = False  # LlamaModel.modify_tensors
    norm_plus_one: bool = False  # Gemma*Model.modify_tensors
    experts: dict[str, str] = field(default_factory=dict)  # HF expert part -> merged HF name


def text_model(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """`TextModel.set_gguf_parameters`."""
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    rope = hp["rope_parameters"]
    params = rope.get("full_attention", rope)
    if params.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(params["factor"])
    w.add_rope_freq_base(params["rope_theta"])
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local)
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if (experts := hp.get("num_local_experts", hp.get("num_experts"))) is not None:
        w.add_expert_count(experts)
    if (used := hp.get("num_experts_per_tok")) is not None:
        w.add_expert_used_count(used)
    if (head_dim := hp.get("head_dim")) is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)


def llama_model(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """`LlamaModel.set_gguf_parameters` (Mixtral and SmolLM3 use it as it is)."""
    text_model(w, hp)
    w.add_vocab_size(hp["vocab_size"])
    w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])


def qwen2_moe(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """`Qwen2MoeModel.set_gguf_parameters` (Qwen3MoeModel inherits it)."""
    text_model(w, hp)
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])


def gemma2(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """`Gemma2Model.set_gguf_parameters`: no TextModel base, so no rope base and no vocab size."""
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_block_count(hp["num_hidden_layers"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
    w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    w.add_sliding_window(hp["sliding_window"])


def gemma3(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """`Gemma3Model.set_gguf_parameters`."""
    text_model(w, hp)
    w.add_rope_freq_base(hp["rope_parameters"]["full_attention"]["rope_theta"])
    if hp.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    if hp.get("sliding_window_pattern") != 1:
        w.add_sliding_window(hp["sliding_window"])


def phi3(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """`Phi3MiniModel.set_gguf_parameters` and the attention factor of its extra tensors."""
    rope_dims = (
        int(hp.get("partial_rotary_factor", 1.0) * hp["hidden_size"]) // hp["num_attention_heads"]
    )
    w.add_context_length(hp["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(hp["original_max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_block_count(hp["num_hidden_layers"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(hp["rope_parameters"]["rope_theta"])
    w.add_sliding_window(hp.get("sliding_window") or 0)
    scale = hp["max_position_embeddings"] / hp["original_max_position_embeddings"]
    orig = hp["original_max_position_embeddings"]
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))


def granite(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """`GraniteModel.set_gguf_parameters`: pops head_dim, writes the multipliers as scales."""
    hp = {k: v for k, v in hp.items() if k != "head_dim"}
    llama_model(w, hp)
    if hp.get("attention_multiplier"):
        w.add_attention_scale(hp["attention_multiplier"])
    if hp.get("embedding_multiplier"):
        w.add_embedding_scale(hp["embedding_multiplier"])
    if hp.get("residual_multiplier"):
        w.add_residual_scale(hp["residual_multiplier"])
    if hp.get("logits_scaling"):
        w.add_logit_scale(hp["logits_scaling"])


def tiny(cls: type[transformers.PretrainedConfig], **overrides: Any) -> Callable[[], Any]:
    return lambda: cls(**{**TINY, **overrides})


MIXTRAL_EXPERTS = {w: f"layers.{{bid}}.feed_forward.experts.{w}.weight" for w in ("w1", "w2", "w3")}
QWEN_EXPERTS = {
    w: f"model.layers.{{bid}}.mlp.experts.{w}.weight" for w in ("down_proj", "gate_proj", "up_proj")
}
CASES = (
    Case(
        "llama",
        A.LLAMA,
        tiny(transformers.LlamaConfig, head_dim=16, attention_bias=True, mlp_bias=True),
        llama_model,
        ("head_dim", "attention_bias", "mlp_bias"),
        permutes_qk=True,
    ),
    Case(
        "mixtral",
        A.LLAMA,
        tiny(transformers.MixtralConfig, head_dim=16, num_local_experts=4, num_experts_per_tok=2),
        llama_model,
        ("head_dim", "num_local_experts", "num_experts_per_tok"),
        permutes_qk=True,
        experts=MIXTRAL_EXPERTS,
    ),
    Case(
        "qwen2",
        A.QWEN2,
        tiny(transformers.Qwen2Config, head_dim=16, tie_word_embeddings=True),
        text_model,
        ("head_dim",),
    ),
    Case(
        "qwen3",
        A.QWEN3,
        tiny(transformers.Qwen3Config, head_dim=32, tie_word_embeddings=True),
        text_model,
        ("head_dim", "attention_bias"),
    ),
    Case(
        "qwen3_moe",
        A.QWEN3MOE,
        tiny(
            transformers.Qwen3MoeConfig,
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,  # as every Qwen3-MoE checkpoint, and llama.cpp, has it
        ),
        qwen2_moe,
        (
            "num_local_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "norm_topk_prob",
            "decoder_sparse_step",
            "mlp_only_layers",
        ),
        experts=QWEN_EXPERTS,
    ),
    Case(
        "gemma2",
        A.GEMMA2,
        tiny(
            transformers.Gemma2Config,
            head_dim=32,
            query_pre_attn_scalar=32,  # llama.cpp's scale: head_dim, as Gemma 2 2B and 9B have
            sliding_window=16,
            attn_logit_softcapping=40.0,
            final_logit_softcapping=20.0,
        ),
        gemma2,
        (
            "head_dim",
            "hidden_activation",
            "query_pre_attn_scalar",
            "layer_types",
            "sliding_window",
            "attn_logit_softcapping",
            "final_logit_softcapping",
        ),
        norm_plus_one=True,
    ),
    Case(
        "gemma3",
        A.GEMMA3,
        tiny(
            transformers.Gemma3TextConfig,
            num_hidden_layers=6,  # one full-attention layer after five sliding ones
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=16,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
        gemma3,
        (
            "head_dim",
            "hidden_activation",
            "query_pre_attn_scalar",
            "layer_types",
            "sliding_window",
            "final_logit_softcapping",
            "attn_logit_softcapping",
        ),
        norm_plus_one=True,
    ),
    Case(
        "phi3",
        A.PHI3,
        tiny(
            transformers.Phi3Config,
            partial_rotary_factor=0.5,
            original_max_position_embeddings=64,
            sliding_window=48,
            rope_scaling={
                "rope_type": "longrope",
                "long_factor": [1.0, 1.25, 1.5, 2.0],
                "short_factor": [1.0, 1.0, 1.125, 1.25],
            },
        ),
        phi3,
        ("partial_rotary_factor", "original_max_position_embeddings", "sliding_window"),
    ),
    Case("olmo2", A.OLMO2, tiny(transformers.Olmo2Config), text_model, ("attention_bias",)),
    Case(
        "granite",
        A.GRANITE,
        tiny(
            transformers.GraniteConfig,
            embedding_multiplier=12.0,
            attention_multiplier=0.1,
            residual_multiplier=0.22,
            logits_scaling=8.0,
        ),
        granite,
        (
            "embedding_multiplier",
            "attention_multiplier",
            "residual_multiplier",
            "logits_scaling",
            "attention_bias",
            "mlp_bias",
        ),
        permutes_qk=True,
    ),
    Case(
        "smollm3",
        A.SMOLLM3,
        tiny(transformers.SmolLM3Config, num_hidden_layers=4, head_dim=16),
        llama_model,
        ("head_dim", "no_rope_layers", "no_rope_layer_interval", "use_sliding_window"),
        permutes_qk=True,
    ),
)


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """`LlamaModel.permute` (given the KV head count for K)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def converted_tensors(
    case: Case, hp: dict[str, Any], state: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) as `modify_tensors` hands them to the tensor map, extras first."""
    if case.arch == A.PHI3:  # Phi3MiniModel.generate_extra_tensors
        rope = hp["rope_parameters"]
        yield "rope_factors_long.weight", torch.tensor(rope["long_factor"])
        yield "rope_factors_short.weight", torch.tensor(rope["short_factor"])
    merged: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, w in state.items():
        if case.arch == A.GEMMA2 and name == "lm_head.weight":
            continue
        if case.norm_plus_one and name.endswith("norm.weight"):
            w = w + 1
        if case.permutes_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = permute(w, hp["num_attention_heads"])
        if case.permutes_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = permute(w, hp["num_key_value_heads"])
        expert = re.fullmatch(r"model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.weight", name)
        if expert is None:
            yield name, w
            continue
        bid, xid, part = int(expert[1]), int(expert[2]), expert[3]
        merged.setdefault((bid, part), {})[xid] = w
    for (bid, part), by_expert in sorted(merged.items()):
        stacked = torch.stack([by_expert[x] for x in sorted(by_expert)], dim=0)
        yield case.experts[part].format(bid=bid), stacked


def write_gguf(
    path: Path, case: Case, hp: dict[str, Any], state: dict[str, torch.Tensor], *, q8_0: bool
) -> None:
    """The converter's `prepare_tensors` and `set_gguf_parameters`, outtype f32 or q8_0."""
    tensor_map = gguf.get_tensor_name_map(case.arch, hp["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[case.arch])
    for name, w in converted_tensors(case, hp, state):
        new_name = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if name.startswith("rope_factors_"):  # named by format_tensor_name: GGUF's already
            new_name = name
        assert new_name is not None, f"the converter's tensor map has no {name}"
        data = w.float().numpy()
        router = re.fullmatch(r"blk\.\d+\.ffn_gate_inp\.weight", new_name) is not None
        if not q8_0 or data.ndim <= 1 or new_name.endswith("_norm.weight") or router:
            writer.add_tensor(new_name, np.ascontiguousarray(data))
        else:
            writer.add_tensor(new_name, gguf.quants.quantize(data, Q.Q8_0), raw_dtype=Q.Q8_0)
    case.metadata(writer, hp)
    writer.add_bos_token_id(hp["bos_token_id"])
    writer.add_eos_token_id(hp["eos_token_id"])
    writer.add_pad_token_id(hp["pad_token_id"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@dataclass(frozen=True)
class Built:
    case: Case
    model: transformers.PreTrainedModel
    state: dict[str, torch.Tensor]  # the checkpoint's safetensors, as save_pretrained wrote it
    config_json: dict[str, Any]
    f32: Path
    q8_0: Path


@pytest.fixture(scope="session", params=CASES, ids=[c.id for c in CASES])
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Built:
    case: Case = request.param
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(case.hf_config()).eval()
    with torch.no_grad():  # random norms and biases, so a misplaced one shows
        for name, param in model.named_parameters():
            if "norm" in name:
                # On a 2^-16 grid, so the converter's w + 1 is exact and so is our - 1.
                base = 0.0 if case.norm_plus_one else 1.0
                param.copy_(torch.round((base + 0.5 * torch.randn_like(param)) * 2**16) / 2**16)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    out = tmp_path_factory.mktemp(case.id)
    model.save_pretrained(out / "hf")
    state = load_file(out / "hf" / "model.safetensors")
    config_json = json.loads((out / "hf" / "config.json").read_text())
    hp = model.config.to_dict()  # what the converter reads (AutoConfig...to_dict())
    write_gguf(out / "f32.gguf", case, hp, state, q8_0=False)
    write_gguf(out / "q8_0.gguf", case, hp, state, q8_0=True)
    return Built(case, model, state, config_json, out / "f32.gguf", out / "q8_0.gguf")


def read(path: Path, **kw: Any) -> tuple[dict[str, Any], dict[str, Any], int]:
    with GGUFCheckpoint.open(path) as checkpoint:
        return checkpoint.config, dict(checkpoint.tensors(**kw)), checkpoint.num_tensors


def test_f32_tensors_are_the_checkpoints(built: Built) -> None:
    _, tensors, num_tensors = read(built.f32)
    assert sorted(tensors) == sorted(built.state)
    assert num_tensors == len(built.state)
    for name, expected in built.state.items():
        assert tensors[name].dtype == torch.float32
        assert torch.equal(tensors[name], expected), name


def test_the_config_is_the_checkpoints(built: Built) -> None:
    config, _, _ = read(built.f32)
    for key in (*COMMON_KEYS, *built.case.keys):
        assert key in config, key
        assert config[key] == built.config_json[key], key
    for key, value in config.items():  # nothing we write contradicts config.json
        if key in built.config_json:
            assert value == built.config_json[key], key


def test_a_model_built_from_the_gguf_gives_the_same_logits(built: Built, tmp_path: Path) -> None:
    config, tensors, _ = read(built.f32)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, TINY["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = built.model(ids).logits
        torch.testing.assert_close(loaded.eval()(ids).logits, expected, rtol=0, atol=1e-5)


def _step_logits(model: Path, **kw: Any) -> tuple[list[int], torch.Tensor]:
    """Our runner's greedy tokens for one prompt, and the logits of its first sample."""
    runner = make_runner(model, **kw)
    capture = CapturingSampler(runner.sampler)
    runner.sampler = capture  # type: ignore[assignment]
    request = DriverRequest(0, [(5 * i) % 120 + 3 for i in range(21)], max_tokens=6)
    Driver(runner, 64, chunk=8).run([request])
    return request.output, capture.logits[0]


def test_our_runner_on_the_gguf_gives_the_safetensors_tokens(built: Built) -> None:
    """F32: the same tokens and logits as from the safetensors directory; Q8_0 kept
    quantized (`--quantization gguf`, experts included): the dequantised model's logits."""
    if built.config_json.get("mlp_bias"):
        pytest.skip("trillm's Llama has no MLP biases")
    tokens, logits = _step_logits(built.f32.parent / "hf")
    gguf_tokens, gguf_logits = _step_logits(built.f32)
    assert gguf_tokens == tokens
    torch.testing.assert_close(gguf_logits, logits, rtol=0, atol=1e-4)
    _, kept = _step_logits(built.q8_0, quantization="gguf")
    _, dequantised = _step_logits(built.q8_0, quantization="none")
    # The kept blocks' products sum in another order than the dense weights' (float32
    # activations both ways); these random models' large weights (initializer_range 0.2)
    # amplify that through the layers to ~2e-3 of the logits' range (SmolLM3, NoPE layers).
    torch.testing.assert_close(kept, dequantised, rtol=0, atol=5e-3 * logits.abs().max().item())


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """What the converter's q8_0 outtype quantizes: matrices, except the routers."""
    return tensor.ndim == 2 and not name.endswith(
        (".mlp.gate.weight", "block_sparse_moe.gate.weight")
    )


def test_q8_0_dequantizes_close_and_stays_quantized_per_tensor(built: Built) -> None:
    _, dense, _ = read(built.q8_0)
    _, kept, num_tensors = read(built.q8_0, keep_quantized=True)
    assert sorted(dense) == sorted(kept) == sorted(built.state)
    assert num_tensors == len(built.state)
    for name, expected in built.state.items():
        if not is_quantized(name, expected):
            assert torch.equal(dense[name], expected), name
            assert torch.equal(kept[name], expected), name
            continue
        # Q8_0: half a step of 1/127 of each block's largest weight, plus that step's float16 error.
        atol = float(expected.abs().max()) / 200
        torch.testing.assert_close(dense[name], expected, rtol=0, atol=atol, msg=name)
        blocks = kept[name]
        assert isinstance(blocks, QuantizedTensor), name  # one per expert for MoE
        assert (blocks.type_name, blocks.shape) == ("Q8_0", tuple(expected.shape)), name
        assert torch.equal(blocks.dequantize(), dense[name]), name


# The architecture table against the model registry.


def test_every_registry_architecture_has_a_row_of_a_registered_model_type() -> None:
    registry = tuple(dict.fromkeys(a for f in FAMILIES for a in f.gguf_architectures))
    assert _gguf_arch.supported_architectures() == registry
    rows = (*_gguf_arch._ARCHITECTURES, _gguf_arch.MIXTRAL)
    assert {c.arch for c in CASES} <= {getattr(A, a.name.upper()) for a in rows}
    for row in rows:
        assert family_for(row.model_type) is not None, row.model_type


def test_an_unsupported_architecture_is_named_with_those_that_are(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = (
        f"{path}: architecture 'gpt2' is not supported; trillm loads GGUF files of the "
        "architectures llama, qwen2, qwen3, gemma2, gemma3, phi3, olmo2, granite, smollm3, qwen3moe"
    )
    with pytest.raises(GGUFError, match=re.escape(message)):
        GGUFCheckpoint.open(path)


def rewrite(built: Built, path: Path, *, extra: str | None = None, **keys: Any) -> Path:
    """`built`'s f32 file again, with a tensor added or metadata values changed."""
    reader = gguf.GGUFReader(built.f32)
    arch = str(reader.get_field("general.architecture").contents())
    writer = gguf.GGUFWriter(path, arch)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.ascontiguousarray(t.data))
    if extra is not None:
        writer.add_tensor(extra, np.ones(4, dtype=np.float32))
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        name = key.removeprefix(f"{arch}.")
        value = keys.pop(name, f.contents())
        if isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
    for name, value in keys.items():
        writer.add_uint32(f"{arch}.{name}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "built", [c for c in CASES if c.id == "gemma2"], indirect=True, ids=["gemma2"]
)
def test_a_tensor_the_family_lacks_is_named(built: Built, tmp_path: Path) -> None:
    path = rewrite(built, tmp_path / "extra.gguf", extra="blk.0.attn_qkv.weight")
    message = (
        f"{path}: tensor 'blk.0.attn_qkv.weight' has no Hugging Face Gemma 2 counterpart "
        "(1 such tensors); this GGUF variant is not supported"
    )
    with pytest.raises(GGUFError, match=re.escape(message)):
        GGUFCheckpoint.open(path)


@pytest.mark.parametrize(
    "built", [c for c in CASES if c.id == "mixtral"], indirect=True, ids=["mixtral"]
)
def test_experts_that_do_not_match_the_expert_count_are_refused(
    built: Built, tmp_path: Path
) -> None:
    path = rewrite(built, tmp_path / "experts.gguf", expert_count=3)
    message = (
        f"{path}: expert tensor blk.0.ffn_gate_exps.weight has shape (4, 64, 64), not 3 experts "
        "of a matrix each; the metadata does not match the tensors"
    )
    with pytest.raises(GGUFError, match=re.escape(message)):
        GGUFCheckpoint.open(path)


@pytest.mark.parametrize(
    "built", [c for c in CASES if c.id == "olmo2"], indirect=True, ids=["olmo2"]
)
def test_olmo_3_is_refused_by_its_sliding_window(built: Built, tmp_path: Path) -> None:
    path = rewrite(built, tmp_path / "olmo3.gguf", **{"attention.sliding_window": 4096})
    message = (
        f"{path}: an olmo2 file with sliding-window attention is OLMo 3, which is not "
        "supported; only OLMo 2 is"
    )
    with pytest.raises(GGUFError, match=re.escape(message)):
        GGUFCheckpoint.open(path)
