"""GGUF checkpoints read as Hugging Face Llama weights.

The default model ships as a GGUF file (llama.cpp's format), but the model runner loads Hugging
Face names and layouts. This module bridges the two: it reads GGUF metadata and tensors with
`gguf.GGUFReader`, dequantises them to float32 with our own vectorised kernels for the types we
meet in practice (the `gguf` package's reference kernels build many temporaries and are kept only
as the fallback and the test oracle), renames tensors to Hugging Face parameter names and undoes
llama.cpp's rotary row permutation of the Q and K projections. With `keep_quantized`, 2-D
Q8_0 / Q4_0 / Q4_1 weights come back still in their blocks (`QuantizedTensor`, whose layouts
`_gguf_blocks` draws), for the weight-only quantized linears of `_quantized`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, overload

import gguf
import numpy as np
import numpy.typing as npt
import torch

from ._gguf_blocks import BLOCK_BYTES, BLOCK_SIZE, QuantizedTensor, dequantize_blocks

Q = gguf.GGMLQuantizationType


class GGUFError(ValueError):
    """A GGUF file that cannot be read as a Llama checkpoint; the message names file and cause."""


def dequantize(
    raw: npt.NDArray[Any], qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """Dequantise one GGUF tensor's data to float32.

    Args:
        raw: the tensor's data as `GGUFReader` gives it (bytes for block types, float16 or
            float32 elements for plain types); only its bytes matter.
        qtype: the tensor's GGML type.
        shape: the logical shape in PyTorch order (the GGUF dims reversed).

    Returns:
        A new float32 tensor of `shape`, not sharing memory with `raw`.

    Raises:
        GGUFError: the byte count does not match `shape` for `qtype`.
    """
    n_elements = int(np.prod(shape, dtype=np.int64))
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if n_elements % block_size or data.size != n_elements // block_size * type_size:
        raise GGUFError(
            f"{qtype.name} data of {data.size} bytes cannot hold a tensor of shape {shape}: "
            f"expected {n_elements // block_size * type_size} bytes; the file is truncated or "
            "its tensor info is wrong"
        )
    out: npt.NDArray[np.float32]
    if qtype == Q.F32:
        out = data.view(np.float32).copy()
    elif qtype == Q.F16:
        out = data.view(np.float16).astype(np.float32)
    elif qtype == Q.BF16:
        # bfloat16 is the top half of a float32: shift its bits into place.
        out = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif qtype in BLOCK_BYTES:
        out = dequantize_blocks(data.reshape(-1, type_size), qtype)
    else:
        out = np.ascontiguousarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)
    return torch.from_numpy(out.reshape(shape))


# GGUF tensor name -> Hugging Face parameter name, for names outside the blocks ...
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# ... and inside block i: GGUF part -> (HF part, whether a bias may accompany the weight).
_BLOCK_NAMES = {
    "attn_norm": ("input_layernorm", False),
    "ffn_norm": ("post_attention_layernorm", False),
    "attn_q": ("self_attn.q_proj", True),
    "attn_k": ("self_attn.k_proj", True),
    "attn_v": ("self_attn.v_proj", True),
    "attn_output": ("self_attn.o_proj", True),
    "ffn_gate": ("mlp.gate_proj", True),
    "ffn_up": ("mlp.up_proj", True),
    "ffn_down": ("mlp.down_proj", True),
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face Llama parameter name for a GGUF tensor name, or None if there is none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match is None or match[2] not in _BLOCK_NAMES:
        return None
    part, may_have_bias = _BLOCK_NAMES[match[2]]
    if match[3] == "bias" and not may_have_bias:
        return None
    return f"model.layers.{match[1]}.{part}.{match[3]}"


def unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute(w, n_head)` of Q or K projection rows (weight or bias).

    llama.cpp rotates interleaved pairs (x0, x1), (x2, x3), ... of each head; Hugging Face's
    `rotate_half` pairs x_i with x_{i + head_dim/2}. The converter reorders each head's rows from
    halves to pairs, `w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)`; this is the inverse.
    """
    rows = w.shape[0]
    return (
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
        .contiguous()
    )


class GGUFCheckpoint:
    """A llama-architecture GGUF file, seen as a Hugging Face `LlamaForCausalLM` checkpoint.

    The file is memory-mapped: tensors are dequantised one at a time as `tensors()` yields them,
    so converting needs memory for one float32 tensor beyond what the caller keeps.
    """

    def __init__(self, path: Path, reader: gguf.GGUFReader, names: dict[str, str]) -> None:
        """Use `GGUFCheckpoint.open`, which validates the file and maps the names."""
        self.path = path
        self._reader: gguf.GGUFReader | None = reader
        self._names = names
        self._config = _llama_config(path, reader, names.values())

    @classmethod
    def open(cls, path: str | Path) -> GGUFCheckpoint:
        """Open and validate a GGUF file.

        Raises:
            GGUFError: the file is missing or unreadable, is not GGUF, is not a llama
                architecture, or holds a tensor with no Hugging Face Llama counterpart.
        """
        path = Path(path)
        if not path.is_file():
            raise GGUFError(f"{path}: no such GGUF file; check the path")
        try:
            reader = gguf.GGUFReader(path)
        except (ValueError, OSError) as exc:
            raise GGUFError(f"{path}: not a readable GGUF file ({exc})") from exc
        arch = _field(reader, "general.architecture")
        if arch != "llama":
            raise GGUFError(
                f"{path}: architecture {arch!r} is not supported; only 'llama' GGUF files "
                "(Llama, SmolLM, Mistral-style models) can be loaded"
            )
        names = {t.name: hf_name(t.name) for t in reader.tensors}
        unknown = [name for name, hf in names.items() if hf is None]
        if unknown:
            raise GGUFError(
                f"{path}: tensor {unknown[0]!r} has no Hugging Face Llama counterpart "
                f"({len(unknown)} such tensors); this GGUF variant is not supported"
            )
        return cls(path, reader, {name: hf for name, hf in names.items() if hf is not None})

    def __enter__(self) -> GGUFCheckpoint:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Drop the memory map (freed once no yielded tensor view refers to it: none do)."""
        self._reader = None

    @property
    def reader(self) -> gguf.GGUFReader:
        """The underlying `gguf.GGUFReader`, for metadata this class does not interpret."""
        if self._reader is None:
            raise GGUFError(f"{self.path}: the checkpoint is closed; open it again")
        return self._reader

    def metadata(self, key: str, default: Any = None) -> Any:
        """A metadata value (str, number, bool or list), or `default` if the key is absent."""
        return _field(self.reader, key, default)

    @property
    def config(self) -> dict[str, Any]:
        """A Hugging Face `config.json` dict for `LlamaForCausalLM` (a fresh copy)."""
        return copy.deepcopy(self._config)

    @property
    def num_tensors(self) -> int:
        """How many tensors `tensors()` yields (for progress bars)."""
        return len(self._names)

    @overload
    def tensors(
        self, *, keep_quantized: Literal[False] = False
    ) -> Iterator[tuple[str, torch.Tensor]]: ...
    @overload
    def tensors(
        self, *, keep_quantized: bool
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]: ...
    def tensors(
        self, *, keep_quantized: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """Yield (Hugging Face name, float32 tensor) pairs, in file order.

        Q and K projections come back in Hugging Face's rotary layout (see `unpermute_rotary`).
        With `keep_quantized`, 2-D Q8_0 / Q4_0 / Q4_1 tensors come as `QuantizedTensor`s (a
        copy of their blocks, not a view of the file) instead.
        """
        heads = {
            ".self_attn.q_proj.": self._config["num_attention_heads"],
            ".self_attn.k_proj.": self._config["num_key_value_heads"],
        }
        head_dim = self._config["head_dim"]
        for t in self.reader.tensors:
            name = self._names[t.name]
            shape = tuple(int(dim) for dim in reversed(t.shape.tolist()))
            w: torch.Tensor | QuantizedTensor
            if keep_quantized and len(shape) == 2 and t.tensor_type in BLOCK_BYTES:
                w = _blocks(t.data, t.tensor_type, shape)
            else:
                w = dequantize(t.data, t.tensor_type, shape)
            for part, n_head in heads.items():
                if part not in name:
                    continue
                if shape[0] != n_head * head_dim or head_dim % 2:
                    raise GGUFError(
                        f"{self.path}: {t.name} has {shape[0]} rows, not {n_head} heads of "
                        f"{head_dim} (an even number); the metadata does not match the tensors"
                    )
                if isinstance(w, QuantizedTensor):  # rows are whole blocks: permute them
                    w = QuantizedTensor(w.qtype, unpermute_rotary(w.blocks, n_head))
                else:
                    w = unpermute_rotary(w, n_head)
            yield name, w


def _blocks(
    raw: npt.NDArray[Any], qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]
) -> QuantizedTensor:
    """One tensor's blocks, copied out of the memory map, as [rows, blocks per row, bytes]."""
    rows, cols = shape
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if cols % BLOCK_SIZE or data.size != rows * cols // BLOCK_SIZE * BLOCK_BYTES[qtype]:
        dequantize(raw, qtype, shape)  # raises GGUFError naming the sizes
    blocks = data.reshape(rows, cols // BLOCK_SIZE, BLOCK_BYTES[qtype]).copy()
    return QuantizedTensor(qtype, torch.from_numpy(blocks))


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _float32(value: Any) -> float:
    """GGUF stores float32; write its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _llama_config(path: Path, reader: gguf.GGUFReader, hf_names: Iterable[str]) -> dict[str, Any]:
    """Translate `llama.*` metadata into a Hugging Face `LlamaConfig` dict.

    Raises:
        GGUFError: a required key is missing, or the file uses a feature `LlamaForCausalLM`
            cannot express (per-layer head counts, partial rotary, unknown rope scaling).
    """

    def get(key: str, default: Any = None) -> Any:
        value = _field(reader, f"llama.{key}", default)
        if value is None:
            raise GGUFError(
                f"{path}: metadata key 'llama.{key}' is missing; the file is incomplete"
            )
        if isinstance(value, list):
            raise GGUFError(f"{path}: per-layer 'llama.{key}' is not supported by Llama")
        return value

    names = set(hf_names)
    hidden = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // n_head))
    rotary_dim = int(get("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise GGUFError(
            f"{path}: partial rotary embeddings ({rotary_dim} of {head_dim} dims per head) are "
            "not supported by Llama"
        )
    embed = [t for t in reader.tensors if t.name == "token_embd.weight"]
    if not embed:
        raise GGUFError(f"{path}: tensor 'token_embd.weight' is missing; the file is incomplete")
    # The embedding's row count is the vocabulary size (GGUF dims are innermost first).
    vocab_size = int(get("vocab_size", int(embed[0].shape[-1])))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(get("attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": vocab_size,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in names,
        "mlp_bias": "model.layers.0.mlp.up_proj.bias" in names,
        "tie_word_embeddings": "lm_head.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        config["pad_token_id"] = pad
    rope_scaling = _rope_scaling(path, reader)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(path: Path, reader: gguf.GGUFReader) -> dict[str, Any] | None:
    """The `rope_scaling` dict for `llama.rope.scaling.*` metadata, or None when unscaled."""
    kind = _field(reader, "llama.rope.scaling.type")
    factor = _field(reader, "llama.rope.scaling.factor")
    if kind is None and _field(reader, "llama.rope.scale_linear") is not None:
        kind, factor = "linear", _field(reader, "llama.rope.scale_linear")  # pre-2024 files
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _float32(factor)}
    if kind == "yarn":
        original = _field(reader, "llama.rope.scaling.original_context_length")
        if original is None:
            raise GGUFError(
                f"{path}: yarn rope scaling without 'llama.rope.scaling.original_context_length'"
            )
        yarn = {
            "rope_type": "yarn",
            "factor": _float32(factor),
            "original_max_position_embeddings": int(original),
        }
        for ours, theirs in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = _field(reader, f"llama.rope.scaling.{ours}")
            if value is not None:
                yarn[theirs] = _float32(value)
        return yarn
    raise GGUFError(f"{path}: rope scaling type {kind!r} is not supported (linear, yarn are)")
