"""Random LoRA adapters in PEFT's format, and peft's merged model as the oracle.

Adapters are seeded and non-trivial: PEFT initialises B to zero (an adapter that changes
nothing), so every B is drawn at random too, large enough that greedy tokens change.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers
from peft import LoraConfig, get_peft_model

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def base_model(model_dir: Path) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def make_adapter(
    model_dir: Path,
    path: Path,
    *,
    seed: int,
    r: int = 8,
    alpha: int = 16,
    targets: Sequence[str] = ALL_TARGETS,
    rslora: bool = False,
    scale: float = 0.1,
) -> Path:
    """Save a random adapter of the model in `model_dir` to `path` (PEFT's format)."""
    torch.manual_seed(seed)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=rslora,
        init_lora_weights=False,
    )
    model = get_peft_model(base_model(model_dir), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, scale)
    model.save_pretrained(path)
    return path


def merged_greedy(model_dir: Path, adapter: Path | None, prompt: list[int], n: int) -> list[int]:
    """peft's merged model's greedy tokens (float32); `adapter` None: the base model's."""
    model = base_model(model_dir)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0
        )
    return [int(t) for t in out[0, len(prompt) :]]


def edit_config(path: Path, **changes: object) -> None:
    """Change fields of an adapter's adapter_config.json (a bad adapter, for the errors)."""
    file = path / "adapter_config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))
