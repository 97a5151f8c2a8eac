"""The model's tokenizer for the frontend, loaded without torch.

`transformers.AutoTokenizer` imports torch (about 250 MiB in the API process) only to choose a
class. A model directory names its class in `tokenizer_config.json`; the fast tokenizer classes
(all `PreTrainedTokenizerFast`) import without torch, so that class is loaded directly. A GGUF
file's tokenizer is rebuilt by transformers' GGUF reader, which does import torch: that runs
once in a child process and is saved beside the other caches, so the API process only reads
the result (DESIGN.md §8, "the API process is lean").
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

# The child's program: transformers' GGUF reader, then a plain save (tokenizer.json and config).
_SAVE_GGUF_TOKENIZER = (
    "import sys\n"
    "from transformers import AutoTokenizer\n"
    "directory, name, out = sys.argv[1:4]\n"
    "AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out)\n"
)


def load_tokenizer(path: str) -> Any:
    """The Hugging Face fast tokenizer of a model directory or GGUF file.

    Raises:
        OSError: no tokenizer there (transformers' message), or the GGUF's could not be
            rebuilt (the child's error is printed above the message).
    """
    if path.endswith(".gguf"):
        path = str(gguf_tokenizer_dir(Path(path)))
    return tokenizer_class(Path(path)).from_pretrained(path)


def tokenizer_class(directory: Path) -> Any:
    """The class `tokenizer_config.json` names, where it is a fast (tokenizers) one; else
    `PreTrainedTokenizerFast` over `tokenizer.json`; else AutoTokenizer (a slow, sentencepiece
    tokenizer: it loads torch, and is the one case that does)."""
    import transformers

    try:
        name = json.loads((directory / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    found = getattr(transformers, name, None) if isinstance(name, str) else None
    fast = transformers.PreTrainedTokenizerFast
    if isinstance(found, type) and issubclass(found, fast):
        return found
    if (directory / "tokenizer.json").is_file():
        return fast
    return transformers.AutoTokenizer


def gguf_tokenizer_dir(gguf: Path, cache_dir: Path | None = None) -> Path:
    """A directory with the GGUF file's tokenizer saved, made once per file (by path, size and
    modification time) in a child process."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    cache_dir = Path.home() / ".cache" / "trillm" / "tokenizers" if cache_dir is None else cache_dir
    out = cache_dir / f"{gguf.stem}-{key.hexdigest()[:16]}"
    if (out / "tokenizer.json").is_file():
        return out
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    argv = [sys.executable, "-c", _SAVE_GGUF_TOKENIZER, str(gguf.parent), gguf.name, str(partial)]
    done = subprocess.run(argv, check=False)
    if done.returncode != 0:
        raise OSError(
            f"could not rebuild the tokenizer of {gguf} (transformers' GGUF reader exited "
            f"{done.returncode}; its error is printed above)"
        )
    try:
        partial.rename(out)
    except OSError:  # another process saved it first: keep theirs
        shutil.rmtree(partial, ignore_errors=True)
    return out
