"""GGUF checkpoints read as Hugging Face checkpoints, for every family in the model registry.

Models ship as GGUF files (llama.cpp's format), but the model runner loads Hugging Face names
and layouts. This module bridges the two: it reads GGUF metadata and tensors with
`gguf.GGUFReader`, dequantises them to float32 with our own vectorised kernels for the types we
meet in practice (the `gguf` package's reference kernels build many temporaries and are kept only
as the fallback and the test oracle), and, through its architecture's row in `_gguf_arch`,
renames tensors to Hugging Face parameter names, undoes the converter's edits (the rotary row
permutation of Q and K, Gemma's norm offset, stacked experts) and translates the metadata into
a `config.json` dict (`_gguf_config`). With `keep_quantized`, 2-D Q8_0 / Q4_0 / Q4_1 weights,
and each expert's slice of a 3-D one, come back still in their blocks (`QuantizedTensor`, whose
layouts `_gguf_blocks` draws), for the weight-only quantized linears of `_quantized`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, overload

import gguf
import numpy as np
import numpy.typing as npt
import torch

from ..quant._gguf_blocks import BLOCK_BYTES, BLOCK_SIZE, QuantizedTensor, dequantize_blocks
from ._gguf_arch import Architecture, Target, architecture_for
from ._gguf_metadata import GGUFError as GGUFError
from ._gguf_metadata import Metadata, field

Q = gguf.GGMLQuantizationType


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
    """A GGUF file of a supported architecture, seen as its Hugging Face checkpoint.

    The file is memory-mapped: tensors are dequantised one at a time (an expert tensor one
    expert at a time) as `tensors()` yields them, so converting needs memory for one float32
    tensor beyond what the caller keeps.
    """

    def __init__(self, path: Path, reader: gguf.GGUFReader, architecture: Architecture) -> None:
        """Use `GGUFCheckpoint.open`, which validates the file and maps the names."""
        self.path = path
        self.architecture = architecture
        self._reader: gguf.GGUFReader | None = reader
        self._config = architecture.config(Metadata(path, reader, architecture.name))
        self._targets = self._plan(reader)

    @classmethod
    def open(cls, path: str | Path) -> GGUFCheckpoint:
        """Open and validate a GGUF file.

        Raises:
            GGUFError: the file is missing or unreadable, is not GGUF, is of an architecture
                trillm does not load, lacks metadata its family needs, or holds a tensor with no
                Hugging Face counterpart in its family.
        """
        path = Path(path)
        if not path.is_file():
            raise GGUFError(f"{path}: no such GGUF file; check the path")
        try:
            reader = gguf.GGUFReader(path)
        except (ValueError, OSError) as exc:
            raise GGUFError(f"{path}: not a readable GGUF file ({exc})") from exc
        arch = field(reader, "general.architecture")
        return cls(path, reader, architecture_for(path, arch, (t.name for t in reader.tensors)))

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
        return field(self.reader, key, default)

    @property
    def config(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dict of the model (a fresh copy)."""
        return copy.deepcopy(self._config)

    @property
    def num_tensors(self) -> int:
        """How many tensors `tensors()` yields (for progress bars): one per expert."""
        return sum(len(target.names) for target in self._targets.values())

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
        """Yield (Hugging Face name, float32 tensor) pairs, in file order, experts in order.

        The tensors are those of the Hugging Face checkpoint the file was converted from: Q and
        K in Hugging Face's rotary layout (see `unpermute_rotary`), Gemma's norms without the
        converter's +1, each expert under its own name. With `keep_quantized`, 2-D Q8_0 / Q4_0
        / Q4_1 weights and experts come as `QuantizedTensor`s (a copy of their blocks, not a
        view of the file) instead.
        """
        for t in self.reader.tensors:
            target = self._targets[t.name]
            if not target.names:
                continue  # read into the config (Phi-3's rope factors)
            shape = tuple(int(dim) for dim in reversed(t.shape.tolist()))
            if target.experts:
                experts = np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)
                slices = experts.reshape(shape[0], -1)  # whole experts: _plan checked
                for name, raw in zip(target.names, slices, strict=True):
                    yield (
                        name,
                        self._load(t.name, raw, t.tensor_type, shape[1:], target, keep_quantized),
                    )
            else:
                yield (
                    target.names[0],
                    self._load(t.name, t.data, t.tensor_type, shape, target, keep_quantized),
                )

    def _plan(self, reader: gguf.GGUFReader) -> dict[str, Target]:
        """Each GGUF tensor's target; raises GGUFError for tensors the family does not have."""
        targets = {
            t.name: self.architecture.target(t.name, int(t.shape[-1])) for t in reader.tensors
        }
        unknown = [name for name, target in targets.items() if target is None]
        if unknown:
            raise GGUFError(
                f"{self.path}: tensor {unknown[0]!r} has no Hugging Face "
                f"{self.architecture.display} counterpart ({len(unknown)} such tensors); this "
                "GGUF variant is not supported"
            )
        experts = self._config.get("num_local_experts", 0)
        for t in reader.tensors:
            target = targets[t.name]
            if (
                target is not None
                and target.experts
                and (len(t.shape) != 3 or int(t.shape[-1]) != experts)
            ):
                raise GGUFError(
                    f"{self.path}: expert tensor {t.name} has shape "
                    f"{tuple(reversed(t.shape.tolist()))}, not {experts} experts of a matrix "
                    "each; the metadata does not match the tensors"
                )
        return {name: target for name, target in targets.items() if target is not None}

    def _load(
        self,
        gguf_name: str,
        raw: npt.NDArray[Any],
        qtype: gguf.GGMLQuantizationType,
        shape: tuple[int, ...],
        target: Target,
        keep_quantized: bool,
    ) -> torch.Tensor | QuantizedTensor:
        """One tensor (or expert) as the Hugging Face checkpoint holds it."""
        w: torch.Tensor | QuantizedTensor
        if keep_quantized and len(shape) == 2 and qtype in BLOCK_BYTES:
            w = _blocks(raw, qtype, shape)
        else:
            w = dequantize(raw, qtype, shape)
        if target.rotary_heads:
            n_head = int(self._config[target.rotary_heads])
            head_dim = int(
                self._config.get("head_dim")
                or self._config["hidden_size"] // self._config["num_attention_heads"]
            )
            if shape[0] != n_head * head_dim or head_dim % 2:
                raise GGUFError(
                    f"{self.path}: {gguf_name} has {shape[0]} rows, not {n_head} heads of "
                    f"{head_dim} (an even number); the metadata does not match the tensors"
                )
            if isinstance(w, QuantizedTensor):  # rows are whole blocks: permute them
                w = QuantizedTensor(w.qtype, unpermute_rotary(w.blocks, n_head))
            else:
                w = unpermute_rotary(w, n_head)
        if target.norm_offset:
            if isinstance(w, QuantizedTensor):  # norms are 1-D, never kept: for the types only
                w = w.dequantize()
            w = w.sub_(target.norm_offset)  # dequantize's result is ours to change
        return w


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
