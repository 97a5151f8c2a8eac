"""The small endpoints' bodies: `/v1/models`, `/tokenize`, `/detokenize`, `/version`,
`/tokenizer_info`."""

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
    object: str = "model"
    owned_by: str = "trillm"
    root: str | None = None  # a LoRA adapter's directory (vLLM's)
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


def models_response(
    model_ids: Iterable[str],
    *,
    max_model_len: int,
    created: int | None = None,
    adapters: Iterable[tuple[str, str, str]] = (),
) -> bytes:
    """`GET /v1/models`: every served model name (`created`: now unless given), then each
    LoRA adapter (name, directory, base model) with its `root` and `parent`, as vLLM's."""
    created = int(time.time()) if created is None else created
    cards = [ModelCard(name, created, max_model_len) for name in model_ids]
    cards += [
        ModelCard(name, created, max_model_len, root=root, parent=parent)
        for name, root, parent in adapters
    ]
    return _encoder.encode(ModelList(cards))


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
