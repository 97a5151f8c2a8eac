"""Request and response bodies of the pooling routes: OpenAI's /v1/embeddings, and vLLM's
/pooling, /score and /rerank (Cohere's shape).

`input` is a string, a list of strings, a list of token ids or a list of lists of them; msgspec
cannot tell list types apart in a union, so it decodes as `str | list[Any]` and `inputs` sorts
it out, naming the field in every refusal.
"""

from __future__ import annotations

import base64
import time
from typing import Any, Literal

import msgspec
import numpy as np

from ..edge._errors import RequestError

Prompt = str | list[int]


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """POST /v1/embeddings (OpenAI's) and POST /pooling (vLLM's)."""

    input: str | list[Any]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka: the first this many, normalised again
    user: str | None = None  # accepted, unused (OpenAI's)
    truncate_prompt_tokens: int | None = None  # keep the last this many tokens (vLLM's)
    normalize: bool | None = None  # vLLM's: None follows the model's pooler
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens around a text
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks shared only within one salt


class ScoreRequest(msgspec.Struct, kw_only=True):
    """POST /score (vLLM's): `text_1` against each of `text_2` (one to many, or pairwise)."""

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None


class RerankRequest(msgspec.Struct, kw_only=True):
    """POST /rerank and /v1/rerank (vLLM's, Cohere's shape)."""

    query: str
    documents: list[str]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None


def inputs(value: str | list[Any], field: str = "input") -> list[Prompt]:
    """The prompts of an `input`: each a text or a list of token ids.

    Raises:
        RequestError: 400 naming `field`: empty, or items of mixed or wrong types.
    """
    if isinstance(value, str):
        items: list[Any] = [value]
    elif value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        items = [value]  # one prompt of token ids
    else:
        items = value
    if not items:
        raise RequestError(400, f"{field} is empty: send at least one text", param=field)
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise RequestError(
                    400, f"{field}[{i}] is an empty string: send some text", param=field
                )
        elif isinstance(item, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in item
        ):
            if not item:
                raise RequestError(400, f"{field}[{i}] is an empty list of token ids", param=field)
        else:
            raise RequestError(
                400,
                f"{field}[{i}] must be a string or a list of token ids (integers), "
                f"got {type(item).__name__}",
                param=field,
            )
    return items


def check_positive(value: int | None, field: str) -> None:
    """400 naming `field` unless it is None or >= 1."""
    if value is not None and value < 1:
        raise RequestError(400, f"{field} must be at least 1, got {value}", param=field)


def encode_vector(rows: np.ndarray, encoding_format: str) -> Any:
    """A result's data as OpenAI sends it: a list of floats (a list of lists for several rows),
    or base64 of the little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(rows, "<f4").tobytes()).decode()
    return rows[0].tolist() if len(rows) == 1 else rows.tolist()


def list_response(
    data: list[dict[str, Any]], model: str, prompt_tokens: int, request_id: str
) -> dict[str, Any]:
    """OpenAI's list body around `data` (each item has its index and object), with usage."""
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
