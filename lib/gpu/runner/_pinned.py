"""A step's host arrays on the device in one copy, through pinned memory, without a sync.

A copy from pageable host memory blocks the host until the device has it (a sync per
tensor); a `non_blocking` copy from pinned memory is queued on the stream and returns. The
staging buffer comes from torch's caching host allocator, which reuses a pinned block only
once the copies queued from it have run, so a buffer is never overwritten mid-copy.

Layout of the one buffer (each array starts on an 8-byte boundary, so every slice can be
viewed as its own dtype on the device):

    | array 0 | pad | array 1 | pad | ... | array n-1 |
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

_ALIGN = 8  # the largest itemsize staged (int64)
_TORCH_DTYPES = {
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float32): torch.float32,
}


class HostStaging:
    """Collects host arrays, then puts them on a device with one non-blocking copy.

    `add` each array and keep its slot, `upload` once, then read each tensor as `self[slot]`.
    On the CPU no copy is made: the tensors share memory with the arrays.
    """

    __slots__ = ("_arrays", "_offsets", "_tensors", "nbytes")

    def __init__(self) -> None:
        self._arrays: list[npt.NDArray[np.generic]] = []
        self._offsets: list[int] = []
        self._tensors: list[torch.Tensor] = []
        self.nbytes = 0  # of the packed buffer

    def add(self, array: npt.NDArray[np.generic]) -> int:
        """Stage an int32, int64 or float32 array (flattened); returns its slot."""
        if array.dtype not in _TORCH_DTYPES:
            raise TypeError(f"cannot stage a {array.dtype} array; use int32, int64 or float32")
        array = np.ascontiguousarray(array).reshape(-1)
        self._arrays.append(array)
        self._offsets.append(self.nbytes)
        self.nbytes += -(-array.nbytes // _ALIGN) * _ALIGN
        return len(self._arrays) - 1

    def upload(self, device: torch.device) -> None:
        """Queue the copy of every staged array to `device`; returns without waiting."""
        if device.type == "cpu" or not self._arrays:
            self._tensors = [torch.from_numpy(a) for a in self._arrays]
            return
        pinned = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        self.pack_into(pinned.numpy())
        self._tensors = self.views(pinned.to(device, non_blocking=True))

    def pack_into(self, buffer: npt.NDArray[np.uint8]) -> None:
        """Write the staged arrays into `buffer` ([nbytes] uint8) at their offsets."""
        for array, offset in zip(self._arrays, self._offsets, strict=True):
            buffer[offset : offset + array.nbytes] = array.view(np.uint8)

    def views(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """Each staged array's tensor, as a view of the packed buffer ([nbytes] uint8)."""
        return [
            packed[offset : offset + array.nbytes].view(_TORCH_DTYPES[array.dtype])
            for array, offset in zip(self._arrays, self._offsets, strict=True)
        ]

    def __getitem__(self, slot: int) -> torch.Tensor:
        """The tensor of a slot, once `upload` has run."""
        return self._tensors[slot]
