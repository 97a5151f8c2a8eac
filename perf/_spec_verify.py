"""spec_bench.py --verify: a verify step's CPU time on the C step and on oneDNN's forward.

The real scheduler drives the real runner (the default model, float32, one thread) with
n-gram speculation always on; each request's prompt is a sentence said eight times, so the
model goes on repeating it and every step verifies k drafts per row (rows x (k + 1)
tokens). Steps alternate between the two paths a verify step can take (`gpu.runner._forward`):
the C step a row per token with `store_first` (`VERIFY_C_STEP_MAX` = 64), and the torch
forward with oneDNN's linears and C's attention (`VERIFY_C_STEP_MAX` = 0). Time is each
`execute`'s CPU seconds (`time.process_time`): on a shared machine a step's wall time is
mostly other people's work.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import torch

from trillm.common.config import WorkerConfig
from trillm.common.speculative import parse_speculative_config
from trillm.default_model import default_model_dir
from trillm.engine.core.sched._request import Request
from trillm.engine.core.sched._scheduler import Scheduler, SchedulerConfig
from trillm.gpu import ModelRunner, SamplingOptions, TensorParallel
from trillm.gpu.loader._weights import open_model
from trillm.gpu.runner import _forward

BLOCK, K, STEPS = 16, 4, 12
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
                   "prompt_lookup_max": 5, "disable_by_batch_size": 4096})  # fmt: skip
SENTENCE = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. "


def verify_paths(rows: tuple[int, ...] = (1, 2, 4, 8, 12)) -> list[dict[str, Any]]:
    """Per row count: median CPU ms of a verify step on each path, tokens, the ratio."""
    torch.set_num_threads(1)
    model = str(default_model_dir())
    # cpu_decode "c": the paths compared are set below (VERIFY_C_STEP_MAX), not measured
    config = WorkerConfig(model, device="cpu", dtype="float32", block_size=BLOCK,
                          max_model_len=1024, max_num_batched_tokens=2048,
                          kv_cache_bytes=1 << 28, speculative_config=SPEC,
                          cpu_decode="c")  # fmt: skip
    model_config, weights = open_model(config.model, config.load_format)
    runner = ModelRunner(config, model_config, TensorParallel(), torch.device("cpu"))
    runner.load_model(weights)
    runner.init_kv_cache(1024)
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(model).encode(SENTENCE * 8)
    out = []
    spec = parse_speculative_config(SPEC)
    for n in rows:
        scheduler = Scheduler(
            SchedulerConfig(num_blocks=1024, block_size=BLOCK, max_num_seqs=64,
                            max_num_batched_tokens=2048, max_model_len=1024,
                            enable_prefix_caching=False, speculative=spec)
        )  # fmt: skip
        options = SamplingOptions(temperature=0.0, ignore_eos=True)
        for r in range(n):
            scheduler.add_request(Request(r, list(prompt), options, 400))
        times: dict[int, list[float]] = {64: [], 0: []}
        tokens: dict[int, list[int]] = {64: [], 0: []}
        for i in range(4 + 2 * STEPS):
            batch = scheduler.schedule()
            limit = (64, 0)[i % 2]
            _forward.VERIFY_C_STEP_MAX = limit
            start = time.process_time()
            output = runner.execute(batch)
            seconds = time.process_time() - start
            scheduler.update_from_output(batch, output)
            if i >= 4 and len(batch.draft_token_ids):  # the prompts' steps done
                times[limit].append(seconds * 1e3)
                tokens[limit].append(int(batch.num_scheduled_tokens.sum()))
        _forward.VERIFY_C_STEP_MAX = 64
        c_ms, onednn_ms = statistics.median(times[64]), statistics.median(times[0])
        out.append({"rows": n, "tokens": statistics.median(tokens[64] + tokens[0]),
                    "c_step_ms": c_ms, "onednn_ms": onednn_ms, "onednn_over_c": onednn_ms / c_ms,
                    "steps": [len(times[64]), len(times[0])]})  # fmt: skip
        print(out[-1], flush=True)
    return out
