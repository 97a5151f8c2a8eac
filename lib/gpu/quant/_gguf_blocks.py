"""GGUF's 32-weight blocks: their layouts, dequantisation, and a weight kept in its blocks.

Block layouts (little endian, 32 weights a block; `d`, `m` are float16):

    Q8_0  | d | q[32] int8 |                   w = d * q
    Q4_0  | d | nibbles[16] |                  w = d * (q - 8)
    Q4_1  | d | m | nibbles[16] |              w = d * q + m

where byte j of `nibbles` holds weight j in its low and weight j + 16 in its high nibble.
Types are GGML's numbers (`gguf.GGMLQuantizationType` is an IntEnum of them), so this module,
which the model's layers import, does not import the `gguf` package.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGML's type numbers
TYPE_NAMES = {Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_1: "Q4_1"}
BLOCK_BYTES = {Q8_0: 34, Q4_0: 18, Q4_1: 20}
BLOCK_SIZE = 32


def dequantize_blocks(blocks: npt.NDArray[np.uint8], qtype: int) -> npt.NDArray[np.float32]:
    """Dequantise (n, block bytes) blocks in a few in-place passes over one output array."""
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)
    out = np.empty((blocks.shape[0], BLOCK_SIZE), dtype=np.float32)
    if qtype == Q8_0:
        out[:] = blocks[:, 2:].view(np.int8)
        out *= d
        return out
    nibbles = blocks[:, 4:] if qtype == Q4_1 else blocks[:, 2:]
    half = BLOCK_SIZE // 2
    np.bitwise_and(nibbles, 0x0F, out=out[:, :half], casting="unsafe")
    np.right_shift(nibbles, 4, out=out[:, half:], casting="unsafe")
    # Same operation order as ggml (and gguf.quants) so the results are bit-identical.
    if qtype == Q4_0:
        out -= 8
        out *= d
    else:
        out *= d
        out += blocks[:, 2:4].view(np.float16).astype(np.float32)
    return out


@dataclass(frozen=True)
class QuantizedTensor:
    """A 2-D GGUF weight kept in its blocks: `blocks` is uint8 [rows, cols // 32, block bytes].

    Rows are output features (PyTorch order), so a row range is a column-parallel shard and a
    block-aligned column range a row-parallel one; neither unpacks a weight.
    """

    qtype: int  # Q8_0, Q4_0 or Q4_1
    blocks: torch.Tensor

    @property
    def type_name(self) -> str:
        return TYPE_NAMES[self.qtype]

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.blocks.shape[1] * BLOCK_SIZE

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def rows(self, start: int, length: int) -> QuantizedTensor:
        """Rows `start:start + length` (a view)."""
        return QuantizedTensor(self.qtype, self.blocks.narrow(0, start, length))

    def cols(self, start: int, length: int) -> QuantizedTensor:
        """Columns `start:start + length`, whole blocks only (a view).

        Raises:
            ValueError: the range does not start and end on a 32-weight block boundary.
        """
        if start % BLOCK_SIZE or length % BLOCK_SIZE:
            raise ValueError(
                f"columns {start}:{start + length} of a {self.type_name} weight split its "
                f"{BLOCK_SIZE}-weight blocks: a tensor-parallel shard of a weight kept "
                f"quantized must be a multiple of {BLOCK_SIZE} columns; choose a "
                f"tensor-parallel size that makes it one, or use --quantization none"
            )
        return QuantizedTensor(
            self.qtype, self.blocks.narrow(1, start // BLOCK_SIZE, length // BLOCK_SIZE)
        )

    def gather_rows(self, index: torch.Tensor) -> torch.Tensor:
        """The float32 rows `index` (an embedding lookup), bit-identical to `dequantize()`."""
        blocks = self.blocks.index_select(0, index.reshape(-1))
        return QuantizedTensor(self.qtype, blocks).dequantize().reshape(*index.shape, -1)

    def dequantize(self) -> torch.Tensor:
        """The float32 [rows, cols] weight, as llama.cpp computes it."""
        flat = self.blocks.contiguous().numpy().reshape(-1, BLOCK_BYTES[self.qtype])
        return torch.from_numpy(dequantize_blocks(flat, self.qtype)).reshape(self.shape)
