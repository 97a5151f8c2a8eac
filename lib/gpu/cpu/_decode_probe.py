"""The CPU decode paths measured at start-up (`cpu_decode="auto"`), and cached.

`decode_paths` times a decode step of B sequences, for B in `SIZES` up to the C step's
`max_batch`, by the C step (`CpuStep.run`) and by the torch forward with C's attention, and
returns the table (`DecodePaths`) that routes every later decode step (`CpuStep.covers`).
Why measure: which is faster depends on the CPU, the model, the dtype and B (`_decode_paths`).

When: at the end of `ModelRunner.load_model`, over a KV cache of its own (at most the KV
budget, freed before the real cache is allocated, so start-up's peak memory does not grow),
not over the real one: the `KernelChoice` that shows the table leaves a worker process with
the KV cache's size, before the cache exists (`_worker_process`, `CMD_LOAD`).

Cached: the table is saved as JSON in `decode_paths/` beside the kernels' cache, under a hash
of what it holds for (the CPU, the C kernels' build, the CPU features and caps oneDNN and ATen
run under, threads, dtype, the model's shape and tiles, the linear path, the sizes); a second
start-up with the same key reads it and measures nothing. An unreadable file is measured again.
The same pass times the torch forward's dense linears on oneDNN and on the C step's tiles
(`_prompt_linears`), kept in the same file.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import msgspec
import numpy as np
import torch

from ..models.llama import KVCache, LlamaForCausalLM
from . import _native
from ._cpu_decode import CpuStep
from ._decode_paths import DecodePaths, DecodeTiming, PromptTiming
from ._hugepages import huge_zeros
from ._prompt_linears import measure_prompt_linears, tiled_linears

SIZES = (1, 4, 16, 32, 64)  # decode steps measured, up to the C step's `max_batch`
CONTEXT = 64  # tokens of context of each synthetic sequence
RUNS = 3  # timed runs a size and path, after one warm-up each; the fastest counts
BUDGET_S = 6.0  # past it no larger size is measured: those take the last size's winner
VERSION = 2  # of the measurement; a change here measures again (2: prompts' linears)


class _Saved(msgspec.Struct, frozen=True):
    """A cache file: what the table holds for, and the table (batch, c ms, torch ms)."""

    key: dict[str, str]
    timings: list[tuple[int, float, float]]
    note: str = ""
    prompt: tuple[int, float, float] | None = None  # tokens, tiles ms, torch ms


def paths_dir() -> Path:
    """Where measured tables are kept: beside the kernels (`$TRILLM_CACHE_DIR`)."""
    return _native.cache_dir().parent / "decode_paths"


def decode_paths(
    step: CpuStep, model: LlamaForCausalLM, *, isa: str, linear: str, kv_budget: int
) -> DecodePaths:
    """The decode paths of `step` (unbound: before the KV cache) on this machine: read from
    the cache, else measured and saved. `isa` (`KernelChoice.isa`: the CPU features and the
    caps oneDNN and ATen run under) and `linear` (the torch forward's linear path) key it;
    `kv_budget` bytes bound the probe's own KV cache."""
    wanted = tuple(b for b in SIZES if b <= step.max_batch)
    per_seq = -(-CONTEXT // step.desc.block_size) * _block_bytes(step, model)
    sizes = tuple(b for b in wanted if b * per_seq <= kv_budget)
    if not sizes:
        why = f"not measured: the KV budget holds no {CONTEXT}-token sequence"
        return DecodePaths(forced="c", note=why)
    key = _key(step, model, isa=isa, linear=linear, sizes=sizes)
    path = paths_dir() / f"{hashlib.sha256(msgspec.json.encode(key)).hexdigest()[:16]}.json"
    saved = _read(path, key)
    if saved is not None:
        return saved
    paths = measure(step, model, sizes)
    layers = tiled_linears(step, model)
    if layers:  # the torch forward's linears: torch's or the tiles' (`_prompt_linears`)
        with torch.inference_mode():
            paths = replace(paths, prompt=measure_prompt_linears(layers[0], step.dtype))
    if sizes != wanted and not paths.note:
        last = sizes[-1]  # the KV budget holds no more
        paths = replace(paths, note=f"measured up to {last} (KV budget), larger steps as {last}")
    _write(path, key, paths)
    return paths


def measure(step: CpuStep, model: LlamaForCausalLM, sizes: tuple[int, ...]) -> DecodePaths:
    """Time a decode step of each of `sizes` sequences both ways, within `BUDGET_S`.

    Each size is one warm-up a path, then `RUNS` runs of each, alternated (the two paths see
    the same machine), their fastest runs compared: other work on the cores only ever adds
    time, so the fastest run is the one nearest the path's own cost (a median on a busy
    2-core machine cached a stall as the answer). A size is skipped, and so are those after it,
    when the last size's time scaled by the batch would overrun the budget: on a CPU where
    the C step is slow its larger sizes take seconds a run.
    """
    if step.bound:
        raise RuntimeError("measure the decode paths before the KV cache: they bind their own")
    cfg, dtype = model.config, step.dtype
    per_seq = -(-CONTEXT // step.desc.block_size)
    shape = (sizes[-1] * per_seq, step.desc.block_size, cfg.num_kv_heads, cfg.head_dim)
    caches: list[KVCache] = [
        (huge_zeros(shape, dtype), huge_zeros(shape, dtype)) for _ in range(cfg.num_layers)
    ]
    counters = step.num_runs, step.num_attention_steps  # the probe's steps are not served ones
    began = time.perf_counter()
    timings: list[DecodeTiming] = []
    note, seconds = "", 0.0
    step.bind(caches)
    try:
        with torch.inference_mode():
            for b in sizes:
                spent = time.perf_counter() - began
                if timings and spent + seconds * b / timings[-1].batch > BUDGET_S:
                    last = timings[-1].batch
                    note = f"measured up to {last} in {BUDGET_S:g} s, larger steps as {last}"
                    break
                start = time.perf_counter()
                timings.append(_measure_size(step, model, caches, b, BUDGET_S - spent))
                seconds = time.perf_counter() - start
    finally:
        step.unbind()
        step.num_runs, step.num_attention_steps = counters
    return DecodePaths(tuple(timings), note=note)


def time_step(run: Callable[[], object]) -> float:
    """Milliseconds `run` (one decode step) takes."""
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) * 1e3


def _measure_size(
    step: CpuStep, model: LlamaForCausalLM, caches: list[KVCache], b: int, budget_s: float
) -> DecodeTiming:
    """The fastest run of a decode step of `b` sequences by each path. Every sequence owns its
    blocks of the probe's cache (zeros: the keys before its token), its one token at position
    `CONTEXT - 1`, written to the same slot every run: nothing but the probe reads it."""
    block_size = step.desc.block_size
    per_seq = -(-CONTEXT // block_size)
    table = np.arange(b * per_seq, dtype=np.int32).reshape(b, per_seq)
    positions = np.full(b, CONTEXT - 1, np.int64)
    slots = table[:, -1].astype(np.int64) * block_size + (CONTEXT - 1) % block_size
    context = np.full(b, CONTEXT, np.int32)
    counts = np.ones(b, np.int32)
    ids = torch.from_numpy((np.arange(b, dtype=np.int64) * 7919 + 11) % model.config.vocab_size)
    rope = torch.from_numpy(model.rotary.rope_positions(positions, counts, context))

    def c_step() -> object:
        return step.run(ids, positions, slots, context, table)

    def torch_forward() -> object:
        return model(ids, rope, caches, step.attention(positions, slots, counts, table))

    warm = time_step(c_step) + time_step(torch_forward)
    runs = max(1, min(RUNS, int((budget_s * 1e3 - warm) / max(warm, 1e-3))))
    c_ms, torch_ms = [], []
    for _ in range(runs):
        c_ms.append(time_step(c_step))
        torch_ms.append(time_step(torch_forward))
    return DecodeTiming(b, min(c_ms), min(torch_ms))


def _block_bytes(step: CpuStep, model: LlamaForCausalLM) -> int:
    """Bytes of one KV block over every layer (K and V): the probe runs at TP 1."""
    cfg = model.config
    element = torch.empty(0, dtype=step.dtype).element_size()
    return cfg.kv_block_bytes(int(step.desc.block_size), cfg.num_kv_heads, element)


def _key(
    step: CpuStep, model: LlamaForCausalLM, *, isa: str, linear: str, sizes: tuple[int, ...]
) -> dict[str, str]:
    """What a measured table holds for, readable (saved with it) and hashed (its name)."""
    cfg = model.config
    shape = (
        cfg.model_type, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
        cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, cfg.num_experts,
        cfg.num_experts_per_tok, cfg.moe_intermediate_size,
    )  # fmt: skip
    return {
        "version": str(VERSION),
        "cpu": _native.cpu_identity(),
        "kernels": step.lib.key,
        "isa": isa,
        "threads": str(torch.get_num_threads()),
        "dtype": str(step.dtype).removeprefix("torch."),
        "model": " ".join(map(str, shape)),
        "operations": step.operations(),
        "tiles": step.kinds(),
        "lora_rank": str(step.desc.lora_rank),
        "linear": linear,
        "block_size": str(step.desc.block_size),
        "sizes": " ".join(map(str, sizes)),
        "measure": f"context {CONTEXT}, best of {RUNS} runs, budget {BUDGET_S:g} s",
    }


def _read(path: Path, key: dict[str, str]) -> DecodePaths | None:
    """The table saved at `path` for `key`; None where there is none, or it cannot be read
    (a corrupt or foreign file is measured again, never fatal)."""
    try:
        saved = msgspec.json.decode(path.read_bytes(), type=_Saved)
    except (OSError, msgspec.DecodeError):
        return None
    batches = [b for b, _, _ in saved.timings]
    if saved.key != key or not batches or batches != sorted(set(batches)):
        return None
    timings = tuple(DecodeTiming(b, c, t) for b, c, t in saved.timings)
    prompt = None if saved.prompt is None else PromptTiming(*saved.prompt)
    return DecodePaths(timings, cached=True, note=saved.note, prompt=prompt)


def _write(path: Path, key: dict[str, str], paths: DecodePaths) -> None:
    """Save `paths` atomically (a temporary file, then a rename: a concurrent start-up reads
    the old file or the new one); a cache that cannot be written only costs a measurement."""
    timings = [(t.batch, t.c_ms, t.torch_ms) for t in paths.timings]
    p = paths.prompt
    prompt = None if p is None else (p.tokens, p.tiles_ms, p.torch_ms)
    data = msgspec.json.encode(_Saved(key, timings, paths.note, prompt))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.stem, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:
        pass
