"""A GGUF file's metadata as the config translation reads it: keys, tensor names, small tensors.

llama.cpp names an architecture's hyper-parameters `{arch}.{key}` (`qwen3.block_count`,
`gemma2.attention.sliding_window`) and the tokenizer's `tokenizer.ggml.*`. `Metadata` reads
both, says which key is missing when a required one is, and lists the file's tensors, so the
translation can tell a tied embedding or a biased projection by what the file holds.

Sizes are checked as they are read (`count`, `positive`): a file is input, and a head count
of 0 or a context of 2**40 must fail here, naming the key and the value, not as a
ZeroDivisionError or an allocation of terabytes later. The caps are generous (the largest
models published are far below them).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Final

import gguf
import numpy as np

MAX_LENGTH: Final = 1 << 20  # embedding, feed-forward and context lengths, in elements
MAX_COUNT: Final = 1 << 12  # layers, attention heads, experts
MAX_HEAD_DIM: Final = 1 << 14
MAX_VOCAB: Final = 1 << 24


class GGUFError(ValueError):
    """A GGUF file that cannot be read as a Hugging Face checkpoint; the message names file and
    cause."""


def field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value (str, number, bool or list), or `default` if the key is absent."""
    value = reader.get_field(key)
    return default if value is None else value.contents()


def float32(value: Any) -> float:
    """GGUF stores float32; write its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


class Metadata:
    """One file's metadata under its architecture's prefix, and the names of its tensors."""

    def __init__(self, path: Path, reader: gguf.GGUFReader, arch: str) -> None:
        self.path = path
        self.arch = arch
        self._reader = reader
        self.tensors = {t.name: t for t in reader.tensors}

    def general(self, key: str, default: Any = None) -> Any:
        """A key outside the architecture's prefix (`tokenizer.ggml.bos_token_id`)."""
        return field(self._reader, key, default)

    def get(self, key: str, default: Any = None) -> Any:
        """`{arch}.{key}`, or `default` if absent.

        Raises:
            GGUFError: the value is a per-layer list, which no supported family has.
        """
        value = field(self._reader, f"{self.arch}.{key}", default)
        if isinstance(value, list):
            raise GGUFError(
                f"{self.path}: metadata '{self.arch}.{key}' has a value per layer; per-layer "
                "settings are not supported"
            )
        return value

    def require(self, key: str) -> Any:
        """`{arch}.{key}`.

        Raises:
            GGUFError: the key is missing (or per layer).
        """
        value = self.get(key)
        if value is None:
            raise GGUFError(
                f"{self.path}: metadata key '{self.arch}.{key}' is missing; the file is incomplete"
            )
        return value

    def count(self, key: str, limit: int, *, default: int | None = None, at_least: int = 1) -> int:
        """`{arch}.{key}` (or `default` if absent) as a whole number in `at_least..limit`.

        Raises:
            GGUFError: the key is missing and has no default, or its value is not a whole
                number in that range; the message names the key, the value and the range.
        """
        value = self.get(key, default)
        if value is None:
            self.require(key)  # raises: missing
        is_whole = isinstance(value, int | np.integer) and not isinstance(value, bool)
        if not is_whole or not at_least <= value <= limit:
            raise GGUFError(
                f"{self.path}: metadata '{self.arch}.{key}' is {value!r}; it must be a whole "
                f"number in {at_least}..{limit}, so the file is damaged or not a model"
            )
        return int(value)

    def positive(self, key: str, default: float | None = None) -> float:
        """`{arch}.{key}` (or `default` if absent) as a finite number above 0, as float32 keeps
        it (`float32`).

        Raises:
            GGUFError: missing without a default, not a number, 0, negative, inf or nan.
        """
        value = self.get(key, default)
        if value is None:
            self.require(key)  # raises: missing
        is_number = isinstance(value, int | float | np.number) and not isinstance(value, bool)
        if not is_number or not (math.isfinite(value) and value > 0):
            raise GGUFError(
                f"{self.path}: metadata '{self.arch}.{key}' is {value!r}; it must be a finite "
                "number above 0, so the file is damaged or not a model"
            )
        return float32(value)

    def has(self, tensor: str) -> bool:
        return tensor in self.tensors

    def rows(self, tensor: str) -> int:
        """The first PyTorch dimension of a tensor (the last GGUF one), e.g. the vocabulary size
        of `token_embd.weight`.

        Raises:
            GGUFError: the tensor is missing.
        """
        if tensor not in self.tensors:
            raise GGUFError(f"{self.path}: tensor {tensor!r} is missing; the file is incomplete")
        return int(self.tensors[tensor].shape[-1])

    def floats(self, tensor: str) -> list[float]:
        """A small float32 tensor's values (Phi-3's rope factors), as shortest decimals.

        Raises:
            GGUFError: the tensor is missing or not stored as F32.
        """
        t = self.tensors.get(tensor)
        if t is None or t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise GGUFError(
                f"{self.path}: tensor {tensor!r} is missing or not F32; the file is damaged"
            )
        return [float32(v) for v in np.asarray(t.data, dtype=np.float32).reshape(-1)]
