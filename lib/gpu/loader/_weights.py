"""Where a model's configuration and weights come from: safetensors dirs, GGUF, or dummy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..models._model_config import ModelConfig, ModelConfigError
from ..quant._gguf_blocks import QuantizedTensor

# GGUF's Q8_0 / Q4_0 / Q4_1 weights come still in their blocks; the model keeps or dequantises
# them (`--quantization`).
Weights = Iterator[tuple[str, torch.Tensor | QuantizedTensor]]


class WeightsError(ValueError):
    """A checkpoint is missing, unreadable, or does not match the model."""


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's shards: from ``model.safetensors.index.json`` or ``*.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightsError(
            f"{model_dir} has no *.safetensors files; use a Hugging Face directory with "
            f"safetensors weights, a GGUF file, or load_format='dummy'"
        )
    return files


def iterate_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every shard, by Hugging Face name."""
    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    yield name, f.get_tensor(name)
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
            if isinstance(exc, WeightsError):
                raise
            raise WeightsError(f"cannot read {path}: {exc} (a corrupt or truncated file?)") from exc


def open_model(model: str, load_format: str) -> tuple[ModelConfig, Weights | None]:
    """The model's config and a lazy iterator over its weights (None for `dummy`).

    Raises:
        ModelConfigError, WeightsError: the path or its contents are not a usable model.
    """
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelConfigError(
            f"model {model!r} does not exist: give a Hugging Face model directory "
            f"(config.json + *.safetensors) or a GGUF file"
        )
    is_gguf = path.suffix == ".gguf" or load_format == "gguf"
    if is_gguf:
        from ._gguf import GGUFCheckpoint

        if not path.is_file():
            raise WeightsError(f"GGUF file {path} does not exist")
        checkpoint = GGUFCheckpoint.open(path)
        config = ModelConfig.from_dict(checkpoint.config, source=str(path))
        return config, (None if load_format == "dummy" else checkpoint.tensors(keep_quantized=True))
    if not path.is_dir():
        raise ModelConfigError(
            f"model {model!r} is neither a directory nor a .gguf file; give a Hugging Face "
            f"model directory (config.json + *.safetensors) or a GGUF file"
        )
    config = ModelConfig.from_model_dir(path)
    if load_format == "dummy":
        return config, None
    safetensors_files(path)  # fail now, with the reason, not at the first tensor
    return config, iterate_safetensors(path)
