"""The small endpoints' bodies: `/v1/models` (and one model's), `/tokenize`, `/detokenize`,
`/version`, `/tokenizer_info`."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import msgspec

_encoder = msgspec.json.Encoder()


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    # vLLM's: the served model's is the model it was started with, an adapter's its name
    # (never a server path but to dev endpoints' users, `_app.App._models`).
    root: str
    object: str = "model"
    owned_by: str = "trillm"
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(msgspec.Struct):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None  # with return_token_strs (vLLM's)


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class VersionResponse(msgspec.Struct, omit_defaults=True):
    version: str
    kernels: dict[str, str] | None = None  # what the model runs with (`KernelChoice`)


def model_cards(
    model_ids: Iterable[str],
    *,
    max_model_len: int,
    created: int | None = None,
    root: str | None = None,
    adapters: Iterable[tuple[str, str, str]] = (),
) -> list[ModelCard]:
    """A card for every served model name (`created`: now unless given; `root`: the model it
    runs, its name unless given), then each LoRA adapter (name, root, base model) with its
    `root` and `parent`, as vLLM's."""
    created = int(time.time()) if created is None else created
    cards = [ModelCard(name, created, max_model_len, root or name) for name in model_ids]
    cards += [
        ModelCard(name, created, max_model_len, adapter_root, parent=parent)
        for name, adapter_root, parent in adapters
    ]
    return cards


def models_response(
    model_ids: Iterable[str],
    *,
    max_model_len: int,
    created: int | None = None,
    root: str | None = None,
    adapters: Iterable[tuple[str, str, str]] = (),
) -> bytes:
    """`GET /v1/models`: the cards of `model_cards`, as a list."""
    cards = model_cards(
        model_ids, max_model_len=max_model_len, created=created, root=root, adapters=adapters
    )
    return _encoder.encode(ModelList(cards))


def model_response(card: ModelCard) -> bytes:
    """`GET /v1/models/{model}`: one card."""
    return _encoder.encode(card)


def tokenize_response(
    tokens: list[int], *, max_model_len: int, token_strs: list[str] | None = None
) -> bytes:
    return _encoder.encode(TokenizeResponse(tokens, len(tokens), max_model_len, token_strs))


def tokenizer_info_response(info: dict[str, Any]) -> bytes:
    return _encoder.encode(info)


def detokenize_response(prompt: str) -> bytes:
    return _encoder.encode(DetokenizeResponse(prompt))


def version_response(version: str, kernels: dict[str, str] | None = None) -> bytes:
    return _encoder.encode(VersionResponse(version, kernels))
