"""Which tokenizer `bench_serve.py` counts tokens with when `--tokenizer` is not given.

`vllm bench serve` takes the tokenizer from the model name. Ours does too where the name is
enough: `trillm serve PATH` serves its model under the name PATH (a directory, or a GGUF file
that carries its tokenizer), and `trillm serve` with no model serves the built-in
SmolLM2-135M-Instruct, whose tokenizer is on this machine. A name that is neither is a hub id
or another server's alias, and then the user must say where the tokenizer is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from _bench_datasets import DatasetError


class TokenizerNotFoundError(DatasetError):
    """The dataset counts tokens, and neither the model name nor the server says which."""

    def __init__(self, dataset: str, model: str, base_url: str) -> None:
        super().__init__(
            f"--dataset {dataset} needs a tokenizer to count tokens; model {model!r} is not a "
            f"local directory or .gguf file, and the server at {base_url} does not list it as "
            "trillm's built-in model: pass --tokenizer PATH (a directory with tokenizer.json, "
            "a .gguf file, or a Hugging Face hub id)"
        )


def served_models(base_url: str, api_key: str | None) -> list[dict[str, Any]]:
    """The model cards of `GET /v1/models` (`id`, `owned_by`, ...).

    Raises:
        ValueError: the server did not answer, or not with a model list.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    url = base_url.rstrip("/") + "/v1/models"
    try:
        resp = httpx.get(url, headers=headers, timeout=30)
        resp.raise_for_status()
        cards = resp.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot list the models at {url} ({e}): is the server up?") from None
    return [card for card in cards if isinstance(card, dict)]


def find_tokenizer(model: str, base_url: str, api_key: str | None) -> str | None:
    """The tokenizer's path for the served `model`, or None when nothing names one.

    The model name itself when it is a local directory or .gguf file; the built-in default
    model's directory (converted on first use, as `trillm serve` does) when the server's
    `/v1/models` lists `model` as owned by trillm and `model` is the default model's name.
    """
    path = Path(model)
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return model
    try:
        cards = served_models(base_url, api_key)
    except ValueError:
        return None  # a server that cannot list its models names no tokenizer either
    if not any(c.get("id") == model and c.get("owned_by") == "trillm" for c in cards):
        return None
    # Imported only for a trillm server: it imports torch, which other servers' users may lack.
    from trillm.default_model import DEFAULT_MODEL_NAME, default_model_dir

    return str(default_model_dir()) if model == DEFAULT_MODEL_NAME else None
