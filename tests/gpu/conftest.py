from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers

from trillm.default_model import default_model_dir
from trillm.gpu import CpuFeatures, ModelRunner, TensorParallel, WorkerConfig, open_model

TINY = dict(
    vocab_size=49152,  # SmolLM2's tokenizer
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
)


def save_tiny(path: Path, kind: str) -> Path:
    """A tiny random Llama (tied embeddings, like SmolLM2), Llama 3 (llama3 RoPE scaling,
    untied, saved in shards) or Qwen2 (qkv bias), saved with SmolLM2's tokenizer."""
    torch.manual_seed(0)
    shard = None
    if kind == "llama":
        config = transformers.LlamaConfig(**TINY, tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
        config = transformers.LlamaConfig(
            **{**TINY, "rope_theta": 500000.0}, rope_scaling=scaling, tie_word_embeddings=False
        )
        model = transformers.LlamaForCausalLM(config)
        shard = "4MB"
    else:
        config = transformers.Qwen2Config(**TINY, tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(config)
        with torch.no_grad():  # random biases, so a wrong bias path shows
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    if shard is None:
        model.save_pretrained(path)
    else:
        model.save_pretrained(path, max_shard_size=shard)
    tokenizer_dir = default_model_dir(progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="session", params=["llama", "llama3", "qwen2"])
def tiny_model_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    return save_tiny(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)


def make_runner(
    model_dir: Path,
    *,
    num_blocks: int = 64,
    block_size: int = 8,
    dtype: str = "float32",
    cpu_features: CpuFeatures | None = None,
    **kw: object,
) -> ModelRunner:
    """A loaded CPU runner; `cpu_features` stands in for the CPU probe's answer. Decode steps
    take the C step (`cpu_decode="c"`) unless told: tests that count its runs must not hang
    on what the measurement (`_decode_probe`) finds on this machine."""
    kw.setdefault("cpu_decode", "c")
    config = WorkerConfig(str(model_dir), device="cpu", dtype=dtype, block_size=block_size, **kw)  # type: ignore[arg-type]
    model_config, weights = open_model(config.model, config.load_format)
    runner = ModelRunner(
        config, model_config, TensorParallel(), torch.device("cpu"), cpu_features=cpu_features
    )
    runner.load_model(weights)
    runner.init_kv_cache(num_blocks)
    return runner
