"""A prompt given as embeddings (vLLM's `prompt_embeds`), decoded and checked without torch.

vLLM decodes the base64 it receives with `torch.load`, which unpickles (a memory-corruption
CVE has been found there); this reads a safetensors blob instead, parsed here by hand: an
8-byte little-endian header length, a JSON header, raw little-endian data. Nothing in it is
executed or unpickled, and the API process imports no torch (safetensors' own numpy loader
would do, but numpy has no bfloat16). The blob must hold exactly one tensor, float16, bfloat16
or float32, of shape [tokens, hidden] with every value finite; it travels to the engine as
float32 bytes (`AddHeader.prompt_embeds`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

MAX_HEADER_BYTES = 1 << 16  # one tensor's header is ~100 bytes; safetensors allows 100 MB
MAX_DIMENSION = 1 << 31  # a row count or width past any model's
_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}  # BF16 is widened by hand


class PromptEmbedsError(ValueError):
    """Prompt embeddings that cannot be used: not one finite float tensor [tokens, hidden],
    or the server does not take them. The caller's 400 (param "prompt_embeds")."""


@dataclass(frozen=True, slots=True)
class PromptEmbeds:
    """A prompt as embeddings: `num_tokens` rows of `hidden_size` float32 (`data`, C order,
    little-endian), checked finite. Build with `from_array` or `from_safetensors`."""

    data: bytes
    num_tokens: int
    hidden_size: int

    @classmethod
    def from_array(cls, array: np.ndarray) -> PromptEmbeds:
        """Embeddings from a 2-D float array [tokens, hidden].

        Raises:
            PromptEmbedsError: not 2-D, empty, not a float array, or not all finite.
        """
        if array.dtype.kind != "f":
            raise PromptEmbedsError(
                f"prompt_embeds must be a float tensor (float16, bfloat16 or float32), got "
                f"{array.dtype}"
            )
        if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] < 1:
            raise PromptEmbedsError(
                f"prompt_embeds must have shape [tokens, hidden] with at least one token, got "
                f"{list(array.shape)}"
            )
        rows = np.ascontiguousarray(array, "<f4")
        if not np.isfinite(rows).all():
            bad = np.argwhere(~np.isfinite(rows))[0].tolist()
            raise PromptEmbedsError(
                f"prompt_embeds must be finite, got {rows[bad[0], bad[1]]} at {bad}"
            )
        return cls(rows.tobytes(), int(rows.shape[0]), int(rows.shape[1]))

    @classmethod
    def from_safetensors(cls, blob: bytes) -> PromptEmbeds:
        """Embeddings from a safetensors file's bytes holding exactly one tensor.

        Raises:
            PromptEmbedsError: not safetensors, not one tensor, or as `from_array`.
        """
        return cls.from_array(_one_tensor(blob))

    def check(self, hidden_size: int, max_model_len: int) -> None:
        """Raise `PromptEmbedsError` unless the rows fit the model: `hidden_size` wide, at
        most `max_model_len` of them."""
        if self.hidden_size != hidden_size:
            raise PromptEmbedsError(
                f"prompt_embeds must have shape [tokens, {hidden_size}] (the model's hidden "
                f"size), got [{self.num_tokens}, {self.hidden_size}]"
            )
        if self.num_tokens > max_model_len:
            raise PromptEmbedsError(
                f"prompt_embeds has {self.num_tokens} tokens, more than the model's maximum "
                f"length {max_model_len}"
            )


def _one_tensor(blob: bytes) -> np.ndarray:
    """The one tensor of a safetensors blob, as a numpy array (bfloat16 widened to float32)."""
    if len(blob) < 8:
        raise PromptEmbedsError(f"prompt_embeds is not safetensors: {len(blob)} bytes")
    size = int.from_bytes(blob[:8], "little")
    if size > min(MAX_HEADER_BYTES, len(blob) - 8):
        raise PromptEmbedsError(
            f"prompt_embeds is not safetensors: a header of {size} bytes in a blob of {len(blob)}"
        )
    try:
        header = json.loads(blob[8 : 8 + size])
    except RecursionError:
        raise PromptEmbedsError(
            "prompt_embeds is not safetensors: its header is nested too deep (one tensor's "
            "header is two levels)"
        ) from None
    except ValueError as exc:  # not JSON, not UTF-8, an integer of over 4,300 digits
        why = str(exc).split(";")[0]  # not Python's advice to raise its digit limit
        raise PromptEmbedsError(f"prompt_embeds is not safetensors: its header: {why}") from None
    tensors = (
        {k: v for k, v in header.items() if k != "__metadata__"} if isinstance(header, dict) else {}
    )
    if len(tensors) != 1:
        raise PromptEmbedsError(f"prompt_embeds must hold exactly one tensor, got {len(tensors)}")
    ((name, info),) = tensors.items()
    if not isinstance(info, dict):
        raise PromptEmbedsError(f"prompt_embeds is not safetensors: tensor {name!r}: {info!r}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise PromptEmbedsError(
            f"prompt_embeds must be float16, bfloat16 or float32 (F16, BF16, F32), got {dtype!r}"
        )
    if not (
        isinstance(shape, list)
        and all(type(n) is int and n >= 0 for n in shape)  # type: a bool is an int too
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(n) is int for n in offsets)
    ):
        raise PromptEmbedsError(
            f"prompt_embeds is not safetensors: tensor {name!r} has shape {_brief(shape)} and "
            f"data_offsets {_brief(offsets)} (both lists of non-negative integers)"
        )
    if len(shape) != 2 or 0 in shape:
        raise PromptEmbedsError(
            f"prompt_embeds must have shape [tokens, hidden] with at least one token, got "
            f"{_brief(shape)}"
        )
    if max(shape) > MAX_DIMENSION:
        raise PromptEmbedsError(
            f"prompt_embeds has shape {_brief(shape)}: a dimension over {MAX_DIMENSION}"
        )
    data = memoryview(blob)[8 + size :]
    begin, end = offsets
    itemsize = np.dtype(_DTYPES[dtype]).itemsize
    if not 0 <= begin <= end <= len(data) or end - begin != itemsize * math.prod(shape):
        raise PromptEmbedsError(
            f"prompt_embeds is not safetensors: tensor {name!r} of shape {shape} ({dtype}) "
            f"has data_offsets {offsets} in {len(data)} bytes of data"
        )
    array = np.frombuffer(data[begin:end], _DTYPES[dtype]).reshape(shape)  # 2-D: checked
    if dtype == "BF16":  # a bfloat16 is a float32's top half
        array = (array.astype("<u4") << 16).view("<f4")
    return array


def _brief(value: object) -> str:
    """`value` for an error message, at most 200 characters (a 5,000-digit integer is not)."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**100 else "a huge int"
    return text if len(text) <= 200 else text[:200] + "..."
