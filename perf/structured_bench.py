"""Structured outputs: what a grammar costs, measured side by side in one run.

Three tables:

1. **Serving**: output tok/s and median TPOT of `json_schema` requests against unconstrained
   ones, same prompts, same `max_tokens`, at each concurrency, through `AsyncLLM` and a real
   engine process on the default model (SmolLM2-135M-Instruct). The schema is an array of at
   least 50 objects, so every constrained request runs to `max_tokens` as the free ones do
   (`ignore_eos`): both produce the same number of tokens.
2. **Mask cost per step** at B rows, in the engine process's terms: filling B bitmask rows
   (`Grammars.start_masks`, llguidance's parallel `LLExecutor`) and applying them to B rows of
   logits (`apply_grammar_bitmask`), medians over decode-like steps.
3. **Compile time** per schema (the engine's `LLMatcher` build; the frontend's check is the
   same work), over a set that includes 64 tools, for llguidance and, when it is importable,
   xgrammar (`--xgrammar`), the candidate vLLM uses by default.

    python perf/structured_bench.py [--concurrency 1,16,64] [--max-tokens 64]
        [--batches 1,64,256] [--xgrammar] [--json perf/results/structured_bench.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trillm.default_model import default_model_dir  # noqa: E402
from trillm.engine import (  # noqa: E402
    EngineConfig,
    LLMConfig,
    SamplingParams,
    StructuredOutputs,
    open_llm,
)
from trillm.engine.core._grammar import Grammars, load_ll_tokenizer  # noqa: E402
from trillm.gpu import WorkerConfig  # noqa: E402
from trillm.gpu.sample._grammar_mask import apply_grammar_bitmask  # noqa: E402
from trillm.http.turn._tools import required_grammar  # noqa: E402

LONG = {  # never complete within max_tokens: constrained requests run as long as free ones
    "type": "array",
    "minItems": 50,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "name": {"type": "string", "maxLength": 16},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "name", "ok"],
        "additionalProperties": False,
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "roles": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "email"],
}
PROMPTS = [
    "List the inventory as JSON.",
    "Write the items we shipped today.",
    "Give me the catalogue entries.",
    "Export the records, please.",
]


def tools(n: int) -> list[dict[str, Any]]:
    """n distinct functions with a few typed parameters each (an agent's tool set)."""
    return [
        {
            "name": f"tool_{i}",
            "description": f"Does task number {i}.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "maxLength": 100},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 100},
                    "mode": {"enum": ["fast", "exact", f"custom_{i}"]},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                },
                "required": ["query", "mode"],
                "additionalProperties": False,
            },
        }
        for i in range(n)
    ]


# -- 1. serving ------------------------------------------------------------------------------


async def serve_round(llm: Any, concurrency: int, max_tokens: int, constrained: bool) -> dict:
    structured = StructuredOutputs(json=LONG) if constrained else None
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, structured_outputs=structured
    )
    await llm.complete(PROMPTS[0], params)  # warm: the grammar compiled, the path run once
    tpots: list[float] = []
    tokens = [0]

    async def one(i: int) -> None:
        first = last = None
        n = 0
        async with llm.generate(PROMPTS[i % len(PROMPTS)], params) as stream:
            async for out in stream:
                now = time.perf_counter()
                first = now if first is None else first
                last, n = now, n + len(out.token_ids)
        tokens[0] += n
        if n > 1 and first is not None and last is not None:
            tpots.append((last - first) / (n - 1))

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(max(concurrency, 4) * 2 if concurrency > 1 else 4):
            if concurrency == 1:
                await one(i)
            else:
                nursery.start_soon(one, i)
    wall = time.perf_counter() - started
    return {
        "tok_s": tokens[0] / wall,
        "tpot_ms": 1e3 * statistics.median(tpots),
        "tokens": tokens[0],
    }


async def serving(concurrencies: list[int], max_tokens: int) -> list[dict]:
    worker = WorkerConfig(str(default_model_dir()), dtype="float32", max_num_seqs=256)
    rows = []
    async with open_llm(LLMConfig(EngineConfig(worker=worker), start_timeout=600)) as llm:
        for c in concurrencies:
            free = await serve_round(llm, c, max_tokens, constrained=False)
            fixed = await serve_round(llm, c, max_tokens, constrained=True)
            rows.append({"concurrency": c, "free": free, "json_schema": fixed,
                         "ratio": fixed["tok_s"] / free["tok_s"]})  # fmt: skip
            print(
                f"c={c:<3} free {free['tok_s']:7.1f} tok/s TPOT {free['tpot_ms']:6.1f} ms | "
                f"json_schema {fixed['tok_s']:7.1f} tok/s TPOT {fixed['tpot_ms']:6.1f} ms | "
                f"ratio {rows[-1]['ratio']:.3f}",
                flush=True,
            )
    return rows


# -- 2. mask cost per step -------------------------------------------------------------------


def mask_cost(batches: list[int], steps: int = 30) -> list[dict]:
    import llguidance

    model = default_model_dir()
    vocab = 49152
    tokenizer = load_ll_tokenizer(str(model), vocab, [2])
    grammar = StructuredOutputs(json=PERSON).to_grammar()
    rows = []
    for batch in batches:
        grammars = Grammars(tokenizer, vocab, timeout=60)
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        states = [_state(template.deep_copy()) for _ in range(batch)]
        rng = np.random.default_rng(0)
        logits = torch.randn(batch, vocab)
        rnums = np.arange(batch, dtype=np.uint64)
        fill, apply = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            wait = grammars.start_masks(states)
            assert wait is not None
            bitmask = wait()
            t1 = time.perf_counter()
            apply_grammar_bitmask(logits, rnums, rnums, bitmask)
            t2 = time.perf_counter()
            fill.append(t1 - t0)
            apply.append(t2 - t1)
            bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
            for state, allowed in zip(states, bits, strict=True):  # advance on an allowed token
                choices = np.flatnonzero(allowed)
                if state.matcher.is_stopped() or not len(choices):
                    continue
                state.accept(int(rng.choice(choices)))
            logits.normal_()
        grammars.close()
        row = {"batch": batch, "fill_ms": 1e3 * statistics.median(fill),
               "apply_ms": 1e3 * statistics.median(apply)}  # fmt: skip
        rows.append(row)
        print(f"B={batch:<4} mask fill {row['fill_ms']:7.3f} ms  apply {row['apply_ms']:7.3f} ms "
              f"per step", flush=True)  # fmt: skip
    return rows


def _state(matcher: Any) -> Any:
    from trillm.engine.core._grammar import GrammarState

    return GrammarState(matcher)


# -- 3. compile time -------------------------------------------------------------------------


def compile_set() -> dict[str, StructuredOutputs]:
    return {
        "json_object": StructuredOutputs(json_object=True),
        "person (nested, pattern, enum)": StructuredOutputs(json=PERSON),
        "array of 50+ objects": StructuredOutputs(json=LONG),
        "regex": StructuredOutputs(regex=r"[A-Z]{3}-\d{4}-[a-z]+"),
        "8 tools (required)": StructuredOutputs(grammar=required_grammar(tools(8), parallel=True)),
        "64 tools (required)": StructuredOutputs(
            grammar=required_grammar(tools(64), parallel=True)
        ),
    }


def compile_times(use_xgrammar: bool, repeats: int = 5) -> list[dict]:
    import llguidance

    model = default_model_dir()
    tokenizer = load_ll_tokenizer(str(model), 49152, [2])
    xg = _xgrammar_compiler(model) if use_xgrammar else None
    rows = []
    for name, constraint in compile_set().items():
        grammar = constraint.to_grammar()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            times.append(time.perf_counter() - t0)
            assert not matcher.is_error(), matcher.get_error()
        row: dict[str, Any] = {"schema": name, "llguidance_ms": 1e3 * statistics.median(times)}
        if xg is not None and constraint.kind in ("json", "json_object"):
            schema = json.dumps(
                constraint.json if constraint.kind == "json" else {"type": "object"}
            )
            t0 = time.perf_counter()
            xg.compile_json_schema(schema)
            row["xgrammar_ms"] = 1e3 * (time.perf_counter() - t0)  # cold: its cache is per text
        elif xg is not None and name.endswith("tools (required)"):
            functions = tools(64 if name.startswith("64") else 8)
            schema = json.dumps({"anyOf": [f["parameters"] for f in functions]})
            t0 = time.perf_counter()
            xg.compile_json_schema(schema)
            row["xgrammar_ms"] = 1e3 * (time.perf_counter() - t0)
        rows.append(row)
        extra = f"  xgrammar {row['xgrammar_ms']:9.1f} ms" if "xgrammar_ms" in row else ""
        print(f"{name:<32} llguidance {row['llguidance_ms']:8.2f} ms{extra}", flush=True)
    return rows


def _xgrammar_compiler(model: Path) -> Any:
    try:
        import xgrammar
        from transformers import AutoTokenizer
    except ImportError as exc:
        print(f"xgrammar is not importable ({exc}): its column is left out", flush=True)
        return None
    info = xgrammar.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(model), vocab_size=49152
    )
    return xgrammar.GrammarCompiler(info, cache_enabled=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--xgrammar", action="store_true")
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    print("== compile time per schema (median of 5; xgrammar: one cold compile) ==", flush=True)
    result["compile"] = compile_times(args.xgrammar)
    print("== mask cost per step ==", flush=True)
    result["mask"] = mask_cost([int(b) for b in args.batches.split(",")])
    if not args.skip_serving:
        print(f"== serving, max_tokens {args.max_tokens}, greedy ==", flush=True)
        concurrencies = [int(c) for c in args.concurrency.split(",")]
        result["serving"] = trio.run(serving, concurrencies, args.max_tokens)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
