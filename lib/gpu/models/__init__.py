"""The model families trillm runs: one module each, and the registry that names them.

The registry is the one list of what is supported: `family_for` finds a Hugging Face
`model_type`'s module (and `ModelConfigError` prints this list when a type is missing),
`model_type_for_gguf` maps a GGUF file's `general.architecture` to its `model_type`. Each
family module has `parse_config(raw) -> dict` (its fields of `ModelConfig`, beyond the
common ones) and `MODEL`, the `nn.Module` class the runner builds. Modules are imported
when their family is asked for, so reading a config imports no model code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Family:
    """One family module and the names it answers to."""

    module: str  # lib/gpu/models/<module>.py
    model_types: tuple[str, ...]  # Hugging Face config.json `model_type`s
    gguf_architectures: tuple[str, ...]  # llama.cpp's `general.architecture` names

    def load(self) -> ModuleType:
        return importlib.import_module(f"{__name__}.{self.module}")


FAMILIES = (
    Family("llama", ("llama", "mistral", "qwen2"), ("llama", "qwen2")),
    Family("qwen3", ("qwen3",), ("qwen3",)),
    Family("gemma", ("gemma2", "gemma3_text"), ("gemma2", "gemma3")),
    Family("phi3", ("phi3",), ("phi3",)),
    Family("olmo2", ("olmo2",), ("olmo2",)),
    Family("granite", ("granite",), ("granite",)),
    Family("smollm3", ("smollm3",), ("smollm3",)),
    Family("moe", ("qwen3_moe", "mixtral"), ("qwen3moe",)),
)
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def supported_model_types() -> tuple[str, ...]:
    return tuple(_BY_TYPE)


def family_for(model_type: object) -> Family | None:
    """The family of a `model_type`, or None when trillm does not run it."""
    return _BY_TYPE.get(model_type) if isinstance(model_type, str) else None
