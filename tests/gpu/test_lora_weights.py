"""Reading PEFT adapters: every bad adapter is refused at load with a message naming it and
what to change; a .bin adapter is never unpickled."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

from trillm.common.wire import LoraModule, LoraModuleError, numbered, parse_lora_module
from trillm.gpu import LoraAdapterError, open_model
from trillm.gpu.lora._lora_weights import read_adapter

from .conftest import TINY, save_tiny
from .lora_adapters import edit_config, make_adapter


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("lora-tiny"), "llama")


@pytest.fixture
def adapter(tiny: Path, tmp_path: Path) -> Path:
    return make_adapter(tiny, tmp_path / "sql", seed=1, r=8, alpha=16)


def read(tiny: Path, path: Path, max_rank: int = 16) -> object:
    config, _ = open_model(str(tiny), "auto")
    return read_adapter(LoraModule("sql", str(path), None, 1), config, max_rank)


def test_a_good_adapter_is_read_with_its_scaling_folded_into_b(tiny: Path, adapter: Path) -> None:
    loaded = read(tiny, adapter)
    from safetensors.torch import load_file

    raw = load_file(adapter / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    _, b = loaded.weights[1, "down_proj"]  # type: ignore[attr-defined]
    assert torch.equal(b, raw[key] * (16 / 8))
    assert len(loaded.weights) == 2 * 7  # type: ignore[attr-defined]


def test_rslora_scales_by_the_square_root_of_the_rank(tiny: Path, tmp_path: Path) -> None:
    path = make_adapter(tiny, tmp_path / "rs", seed=2, r=16, alpha=8, rslora=True)
    from safetensors.torch import load_file

    raw = load_file(path / "adapter_model.safetensors")
    _, b = read(tiny, path).weights[0, "q_proj"]  # type: ignore[attr-defined]
    assert torch.allclose(
        b, raw["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] * 2
    )


def test_a_pickled_adapter_is_refused_and_never_unpickled(
    tiny: Path, adapter: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.bin").write_bytes(pickle.dumps({"x": 1}))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load"))
    with pytest.raises(
        LoraAdapterError,
        match=r"'sql': no adapter this server can read.*a pickled adapter_model.bin is never",
    ):
        read(tiny, adapter)


def test_an_unknown_target_is_refused(tiny: Path, adapter: Path) -> None:
    edit_config(adapter, target_modules=["q_proj", "lm_head"])
    with pytest.raises(LoraAdapterError, match=r"unsupported target modules \['lm_head'\]"):
        read(tiny, adapter)


def test_a_rank_over_the_limit_is_refused(tiny: Path, adapter: Path) -> None:
    with pytest.raises(LoraAdapterError, match="rank 8 is over --max-lora-rank 4"):
        read(tiny, adapter, max_rank=4)


def test_an_adapter_of_another_base_model_is_refused(tiny: Path, tmp_path: Path) -> None:
    import transformers

    other = tmp_path / "other"
    config = transformers.LlamaConfig(**{**TINY, "hidden_size": 32})
    transformers.LlamaForCausalLM(config).save_pretrained(other)
    shutil.copy(tiny / "tokenizer.json", other / "tokenizer.json")
    path = make_adapter(other, tmp_path / "wrong", seed=3)
    with pytest.raises(LoraAdapterError, match="trained on another base model"):
        read(tiny, path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "use_dora=True is not supported"),
        ({"bias": "all"}, "bias='all' is not supported"),
        ({"peft_type": "IA3"}, "not a LoRA adapter's"),
    ],
)
def test_what_plain_lora_does_not_compute_is_refused(
    tiny: Path, adapter: Path, change: dict[str, object], message: str
) -> None:
    edit_config(adapter, **change)
    with pytest.raises(LoraAdapterError, match=message):
        read(tiny, adapter)


def test_lora_modules_parse_in_both_of_vllms_forms() -> None:
    assert parse_lora_module("sql=/a/sql") == LoraModule("sql", "/a/sql")
    spec = '{"name": "sql", "path": "/a", "base_model_name": "base"}'
    assert parse_lora_module(spec) == LoraModule("sql", "/a", "base")
    with pytest.raises(LoraModuleError, match="give name=path"):
        parse_lora_module("sql")
    assert [m.lora_int_id for m in numbered([LoraModule("a", "/a"), LoraModule("b", "/b")])] == [
        1,
        2,
    ]
    with pytest.raises(LoraModuleError, match="distinct names"):
        numbered([LoraModule("a", "/a"), LoraModule("a", "/b")])
