"""Pooling (embeddings) on the frontend: the model's pooler settings and the last touches.

The engine returns each pooling request's raw pooled hidden state (float32, `wire.PoolingType`
says how it was pooled). What stays here, per request and in numpy: truncating to Matryoshka
`dimensions`, then normalising, so the engine's block is the same whatever a client asks.

The pooler's settings come, as vLLM's do, from the model folder's sentence-transformers files
(`modules.json` naming a `Pooling` module, its `config.json`, and a `Normalize` module), with
`--pooler-config '{"pooling_type": ..., "normalize": ...}'` overriding what it names; a
decoder model with neither pools LAST and normalises.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ....common.wire import PoolingType

POOLING_TYPES = {t.name: t for t in PoolingType if t is not PoolingType.NONE}

# sentence-transformers' Pooling config keys, in the order it checks them, and our type.
_ST_MODES = (
    ("pooling_mode_cls_token", PoolingType.CLS),
    ("pooling_mode_mean_tokens", PoolingType.MEAN),
    ("pooling_mode_lasttoken", PoolingType.LAST),
)


class PoolerConfigError(ValueError):
    """--pooler-config (or the model's sentence-transformers files) is not one we can use;
    the message names the setting and what is accepted."""


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """How the model's embeddings are made: the pooling type and whether they are normalised."""

    pooling_type: PoolingType = PoolingType.LAST
    normalize: bool = True


@dataclass(slots=True)
class PoolingOutput:
    """One pooling request's result: its pooled rows (float32 [rows, hidden]; one row but for
    ALL pooling) as the engine sent them, and the prompt's token counts for usage."""

    data: np.ndarray
    num_prompt_tokens: int
    num_cached_tokens: int = 0


def load_pooler_config(model_dir: str, override: str | None = None) -> PoolerConfig:
    """The pooler of the model in `model_dir`: its sentence-transformers files if any, with
    `override` (--pooler-config's JSON) replacing the keys it names.

    Raises:
        PoolerConfigError: `override` is not a JSON object of known keys and values.
    """
    config = _from_sentence_transformers(model_dir) or PoolerConfig()
    given = parse_pooler_override(override)
    return PoolerConfig(
        given.get("pooling_type", config.pooling_type), given.get("normalize", config.normalize)
    )


def parse_pooler_override(override: str | None) -> dict[str, Any]:
    """--pooler-config's JSON as checked settings ({} for none): `pooling_type` (a
    `PoolingType`) and `normalize` (a bool), each only if given.

    Raises:
        PoolerConfigError: not a JSON object, an unknown key, or a value out of range.
    """
    if not override:
        return {}
    try:
        given = json.loads(override)
    except json.JSONDecodeError as exc:
        raise PoolerConfigError(f"--pooler-config is not JSON ({exc}): {override!r}") from None
    if not isinstance(given, dict):
        raise PoolerConfigError(f"--pooler-config must be a JSON object, got {override!r}")
    unknown = sorted(set(given) - {"pooling_type", "normalize"})
    if unknown:
        raise PoolerConfigError(
            f"--pooler-config: unknown key(s) {', '.join(unknown)}; known: pooling_type, normalize"
        )
    settings: dict[str, Any] = {}
    if "pooling_type" in given:
        name = given["pooling_type"]
        if not isinstance(name, str) or name.upper() not in POOLING_TYPES:
            raise PoolerConfigError(
                f"--pooler-config: pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                f"got {name!r}"
            )
        settings["pooling_type"] = POOLING_TYPES[name.upper()]
    if "normalize" in given:
        if not isinstance(given["normalize"], bool):
            raise PoolerConfigError(
                f"--pooler-config: normalize must be true or false, got {given['normalize']!r}"
            )
        settings["normalize"] = given["normalize"]
    return settings


def _from_sentence_transformers(model_dir: str) -> PoolerConfig | None:
    """The pooler `modules.json` describes, or None without one (or without a Pooling module)."""
    try:
        with open(os.path.join(model_dir, "modules.json")) as f:
            modules = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(modules, list):
        return None
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling = types.get("Pooling")
    if pooling is None:
        return None
    try:
        with open(os.path.join(model_dir, str(pooling.get("path", "")), "config.json")) as f:
            settings = json.load(f)
    except (OSError, ValueError):
        return None
    kind = next((t for key, t in _ST_MODES if settings.get(key)), PoolingType.LAST)
    return PoolerConfig(kind, "Normalize" in types)


def finish_embedding(rows: np.ndarray, *, normalize: bool, dimensions: int | None) -> np.ndarray:
    """Pooled rows [n, hidden] as the client gets them: cut to the first `dimensions` columns
    (Matryoshka), then scaled to unit length when `normalize` (so a cut vector is unit too)."""
    if dimensions is not None:
        rows = rows[:, :dimensions]
    rows = rows.astype(np.float32, copy=True)
    if normalize:
        norms = np.linalg.norm(rows, axis=1, keepdims=True)
        rows /= np.maximum(norms, 1e-12)
    return rows
