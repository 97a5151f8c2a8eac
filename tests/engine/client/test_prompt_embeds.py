"""`PromptEmbeds`: safetensors read by hand (never a pickle), each refusal word for word."""

from __future__ import annotations

import io
import json
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save

from trillm.engine.client import PromptEmbeds, PromptEmbedsError


def blob(tensors: dict[str, torch.Tensor]) -> bytes:
    return save(tensors)


def raw(header: Any, data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_one_float_tensor_becomes_float32_rows(dtype: torch.dtype) -> None:
    values = torch.tensor([[0.5, -1.25, 3.0], [2.0, 0.0, -0.375]], dtype=dtype)
    embeds = PromptEmbeds.from_safetensors(blob({"embeds": values}))
    assert (embeds.num_tokens, embeds.hidden_size) == (2, 3)
    rows = np.frombuffer(embeds.data, "<f4").reshape(2, 3)
    assert rows.tolist() == values.float().tolist()  # exact in every dtype: these are


NOT_ST = "prompt_embeds is not safetensors: "
ONE = "prompt_embeds must hold exactly one tensor, got "
FLOATS = "prompt_embeds must be float16, bfloat16 or float32 (F16, BF16, F32), got "


def entry(dtype: str, shape: Any, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [0, end]}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x01\x02", NOT_ST + "2 bytes"),
        ((100).to_bytes(8, "little") + b"{}", NOT_ST + "a header of 100 bytes in a blob of 10"),
        (
            raw({})[:8] + b"\xff" * 4,
            NOT_ST + "its header: 'utf-8' codec can't decode byte 0xff in position 0: invalid "
            "start byte",
        ),
        (raw({}), ONE + "0"),
        (raw([1, 2]), ONE + "0"),
        (raw({"a": entry("F32", [1], 4), "b": entry("F32", [1], 4)}, bytes(4)), ONE + "2"),
        (raw({"a": entry("I32", [1, 1], 4)}, bytes(4)), FLOATS + "'I32'"),
        (raw({"a": entry("F64", [1, 1], 8)}, bytes(8)), FLOATS + "'F64'"),
        (
            raw({"a": entry("F32", [2, 2], 8)}, bytes(8)),
            NOT_ST + "tensor 'a' of shape [2, 2] (F32) has data_offsets [0, 8] in 8 bytes of data",
        ),
        (
            raw({"a": entry("F32", "2x2", 16)}, bytes(16)),
            NOT_ST + "tensor 'a' has shape '2x2' and data_offsets [0, 16] (both lists of "
            "non-negative integers)",
        ),
    ],
)
def test_what_is_not_one_float_tensor_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(PromptEmbedsError) as caught:
        PromptEmbeds.from_safetensors(data)
    assert str(caught.value) == message


SHAPE = "prompt_embeds must have shape [tokens, hidden] with at least one token, got "
FINITE = "prompt_embeds must be finite, got "


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (torch.zeros(4), SHAPE + "[4]"),
        (torch.zeros(1, 2, 3), SHAPE + "[1, 2, 3]"),
        (torch.zeros(0, 3), SHAPE + "[0, 3]"),
        (torch.tensor([[1.0, float("nan")]]), FINITE + "nan at [0, 1]"),
        (torch.tensor([[1.0], [float("-inf")]]), FINITE + "-inf at [1, 0]"),
        (torch.tensor([[70000.0]]).half(), FINITE + "inf at [0, 0]"),
    ],
)
def test_a_wrong_shape_or_a_nan_is_refused(values: torch.Tensor, message: str) -> None:
    with pytest.raises(PromptEmbedsError) as caught:
        PromptEmbeds.from_safetensors(blob({"embeds": values}))
    assert str(caught.value) == message


def test_the_rows_must_fit_the_model() -> None:
    embeds = PromptEmbeds.from_array(np.zeros((3, 8), np.float32))
    embeds.check(8, 3)
    wide = (
        r"^prompt_embeds must have shape \[tokens, 16\] \(the model's hidden size\), got \[3, 8\]$"
    )
    with pytest.raises(PromptEmbedsError, match=wide):
        embeds.check(16, 3)
    long = r"^prompt_embeds has 3 tokens, more than the model's maximum length 2$"
    with pytest.raises(PromptEmbedsError, match=long):
        embeds.check(8, 2)


def test_a_pickle_is_never_unpickled(monkeypatch: pytest.MonkeyPatch) -> None:
    """What vLLM's `torch.load` would run: here it is only bytes that are not safetensors."""
    calls: list[str] = []

    def refuse(name: str) -> Any:
        def called(*args: object, **kwargs: object) -> None:
            calls.append(name)
            raise AssertionError(f"{name} was called")

        return called

    buffer = io.BytesIO()
    torch.save(torch.zeros(2, 3), buffer)
    for module, name in ((torch, "load"), (pickle, "loads"), (pickle, "load")):
        monkeypatch.setattr(module, name, refuse(f"{module.__name__}.{name}"))
    monkeypatch.setattr(pickle, "Unpickler", refuse("pickle.Unpickler"))
    for data in (buffer.getvalue(), pickle.dumps(np.zeros((2, 3), np.float32))):
        with pytest.raises(PromptEmbedsError, match=r"^prompt_embeds is not safetensors"):
            PromptEmbeds.from_safetensors(data)
    assert calls == []
