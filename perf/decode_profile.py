"""Where one batch-1 decode step's time goes, against the memory-bandwidth floor.

Runs a 128-token prompt and `--new-tokens` greedy decode steps through trillm's model runner
(the built-in SmolLM2-135M, CPU) twice, interleaved run by run: with the C decode step
(`lib/gpu/cpu/_cpu_decode.py`, the default) and with the torch forward (`--enforce-eager`); then
each under the torch profiler. With `--batch B` > 1 (B prompts decoding together) a third
path runs too, `c_attention`: what decode steps above the C step's `MAX_BATCH` run (oneDNN's
linears, C's attention). Prints:
- each path's median decode step (ms) and the floor: the bytes one step must read (every
  linear weight once, and the LM head) over the machine's read bandwidth, a 1 GiB `torch.sum`
  measured in the same run (`model_bench.read_bandwidth`, the median of 7);
- torch ops per step and the profiler's self time grouped: linears, attention, other (the C
  step is one call the profiler does not see into).

    python perf/decode_profile.py [--dtype float32] [--batch 1] [--new-tokens 32] [--json PATH]

`--split` (issue 32) instead splits the C path's decode steps of B sequences, and mixed steps
(those B decodes and a new prompt of `--prompt-len` tokens), into linears, attention,
sampling and host work (`_step_split.py`), each part's GFLOP/s against the FMA peak measured
in the same run (a 2048 and a 4096 square fp32 matmul, oneDNN's and MKL's, on every thread):

    python perf/decode_profile.py --split --batch 32 [--new-tokens 24] [--repeats 3]
        [--threads 1 --cpu-time]

On a busy machine two OpenMP threads wait for each other at every barrier while the other
work holds the cores, and wall times mean little: `--threads 1 --cpu-time` measures one
thread's efficiency by the process's CPU time instead, the peak likewise.

`--split --interfere BUSY_MS,PERIOD_MS` runs a child process beside the split that spins for
BUSY_MS and sleeps PERIOD_MS, over and over: a stand-in for the API server and the client
that share a serving run's cores with the engine (each takes a core for bursts while the
step's threads meet at barriers), to see what such bursts cost the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from _step_split import PARTS, decode_and_mixed, products_alone, split, step_flops
from compare import matmul_rates
from model_bench import SamplingOptions, prompts, read_bandwidth, trillm_run
from torch.profiler import profile

from trillm.default_model import default_model_dir
from trillm.gpu import Worker, WorkerConfig

LINEAR = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear")


def weight_bytes(worker: Worker) -> int:
    """Bytes one decode step reads at least: the model's own count (dense, packed for
    oneDNN or quantized; the embedding table only by row)."""
    model = worker.runner.model
    assert model is not None
    return model.decode_read_bytes()


SPIN = """
import sys, time
busy, period = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(period)
"""


@contextmanager
def interference(spec: str) -> Iterator[None]:
    """A child spinning `BUSY_MS` every `PERIOD_MS` while the block runs ("": none)."""
    if not spec:
        yield
        return
    busy, period = (float(v) for v in spec.split(","))
    print(f"decode_profile: a child spins {busy} ms, then sleeps {period} ms, throughout")
    child = subprocess.Popen([sys.executable, "-c", SPIN, str(busy), str(period)])
    try:
        yield
    finally:
        child.kill()
        child.wait()


def load(args: argparse.Namespace, *, eager: bool) -> Worker:
    config = WorkerConfig(
        args.model or str(default_model_dir()),
        device="cpu",
        dtype=args.dtype,
        max_num_seqs=max(8, args.batch + 1),  # + 1: --split's arriving prompt
        quantization=args.quantization,
        cpu_linear=args.cpu_linear,
        cpu_decode="c",  # the paths are chosen here (`max_batch`), not by the start-up's timing
        enforce_eager=eager,
    )
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    worker.init_kv_cache(worker.num_available_kv_blocks())
    return worker


def op_profile(worker: Worker, batch: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Torch ops per step and their self time grouped (the C step is one opaque call)."""
    with profile() as prof:
        trillm_run(worker, batch, new_tokens)
    groups: Counter[str] = Counter()
    ops = 0
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3 / new_tokens
        ops += event.count
        if event.key in LINEAR:
            groups["linears"] += ms
        elif "attention" in event.key or "sdpa" in event.key:
            groups["attention"] += ms
        else:
            groups["other"] += ms
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
    return {
        "torch_ops_per_step": ops / new_tokens,
        "self_ms_per_step": dict(groups),
        "top": [
            (e.key, e.count / new_tokens, e.self_cpu_time_total / 1e3 / new_tokens) for e in top
        ],
    }


def split_main(args: argparse.Namespace) -> None:
    """The C path's decode and mixed steps split into parts, against the FMA peak."""
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    worker = load(args, eager=False)
    step = worker.runner.cpu_step
    if step is None:
        raise SystemExit(f"decode_profile: no C step here ({worker.kernels.decode})")
    if args.c_step_max is not None:  # larger decode steps: the torch forward, C's attention
        step.max_batch = min(step.max_batch, args.c_step_max)
    c_decode = step.covers(args.batch)
    config = worker.runner.model_config
    batch = prompts(args.batch, args.prompt_len, config.vocab_size)
    greedy = SamplingOptions(temperature=0.0)
    decode: list[dict[str, float]] = []
    mixed: list[dict[str, float]] = []
    products: list[float] = []
    decode_and_mixed(worker, batch, 6, greedy, clock)  # warm-up
    for _ in range(args.repeats):  # the products alone between runs: the same machine state
        d, m = decode_and_mixed(worker, batch, args.new_tokens, greedy, clock)
        decode += d
        mixed += m
        if c_decode:
            products.append(products_alone(worker, args.batch, 5, clock))
    rates = matmul_rates(torch.get_num_threads(), (2048, 4096), clock)
    peak = max(rates.values())
    context = args.prompt_len + args.new_tokens // 2
    rows = []
    for name, steps, alone, prompt in (
        ("decode", decode, statistics.median(products) if c_decode else None, 0),
        ("mixed", mixed, None, args.prompt_len),
    ):
        parts = split(steps, alone)
        flops = step_flops(config, args.batch, context, prompt)
        total = sum(flops.values())
        rows.append((name, "step", parts["wall"], total))
        rows += [(name, part, parts[part], flops.get(part, 0.0)) for part in PARTS]
    print(f"fma peak: {peak:.1f} GFLOP/s on {torch.get_num_threads()} threads (" + ", ".join(
        f"{k} {v:.1f}" for k, v in rates.items()) + "); "
        f"{len(decode)} decode and {len(mixed)} mixed steps of B={args.batch}, "
        f"context ~{context}, prompt {args.prompt_len}")  # fmt: skip
    print(f"{'step':>6} {'part':>9} {'ms':>8} {'GFLOP':>7} {'GFLOP/s':>8} {'of peak':>8}")
    for name, part, seconds, flop in rows:
        rate = flop / seconds / 1e9 if flop and seconds > 0 else 0.0
        share = f"{rate / peak:>7.1%}" if flop else f"{'':>7}"
        print(f"{name:>6} {part:>9} {seconds * 1e3:>8.2f} {flop / 1e9:>7.2f} {rate:>8.1f} {share}")
    if args.json:
        args.json.write_text(json.dumps({"rates": rates, "rows": rows}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--no-huge-pages", action="store_true",
        help="tiled weights and KV cache on plain pages (`_hugepages`), to measure them",
    )  # fmt: skip
    p.add_argument(
        "--no-amx", action="store_true",
        help="bfloat16: the C step's FMA tiles, not its AMX tiles (AMX or vdpbf16ps products: "
        "`_tiles.AMX_ENABLED`)",
    )  # fmt: skip
    p.add_argument("--model", help="default: the built-in SmolLM2 (its float32 conversion)")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--cpu-linear", default="auto", help="auto, onednn or aten (MKL)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    p.add_argument("--json", type=Path)
    p.add_argument("--split", action="store_true", help="parts and GFLOP/s of the C path")
    p.add_argument("--threads", type=int, default=0, help="--split: torch threads (0: as is)")
    p.add_argument("--cpu-time", action="store_true", help="--split: process CPU time")
    p.add_argument(
        "--c-step-max", type=int, help="--split: the C step's max_batch lowered to this"
    )  # fmt: skip
    p.add_argument("--interfere", default="", help="--split: BUSY_MS,PERIOD_MS (see above)")
    args = p.parse_args()
    if args.no_huge_pages:
        from trillm.gpu.cpu import _hugepages

        _hugepages.ENABLED = False
    if args.no_amx:
        from trillm.gpu.cpu import _tiles

        _tiles.AMX_ENABLED = False
    if args.split:
        with interference(args.interfere):
            split_main(args)
        return
    workers = {"c": load(args, eager=False), "torch": load(args, eager=True)}
    decode = workers["c"].runner.cpu_step
    if decode is None:
        print(f"decode_profile: no C step here ({workers['c'].kernels.decode})")
        del workers["c"]
    elif args.batch > 1:  # the path of batches above the C step's: oneDNN + C attention
        workers["c_attention"] = load(args, eager=False)
        attention_only = workers["c_attention"].runner.cpu_step
        assert attention_only is not None
        attention_only.max_batch = 0  # (only lowered: its scratch is sized for the build's)
    vocab = workers["torch"].runner.model_config.vocab_size
    batch = prompts(args.batch, args.prompt_len, vocab)
    steps: dict[str, list[float]] = {name: [] for name in workers}
    for worker in workers.values():
        trillm_run(worker, batch, 4)  # warm-up
    for _ in range(args.repeats):  # interleaved: both paths see the same machine state
        for name, worker in workers.items():
            decode_s = trillm_run(worker, batch, args.new_tokens)[1]
            steps[name].append(decode_s / (args.new_tokens - 1) * 1e3)
    bandwidth = read_bandwidth()
    floor = weight_bytes(workers["torch"]) / bandwidth * 1e3
    result: dict[str, Any] = {
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "weight_bytes": weight_bytes(workers["torch"]),
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "floor_ms": floor,
    }
    for name, worker in workers.items():
        median = statistics.median(steps[name])
        result[name] = {
            "kernels": worker.kernels.describe(),
            "decode_step_ms_median": median,
            "decode_step_ms_all": steps[name],
            "ratio_to_floor": median / floor,
            **op_profile(worker, batch, args.new_tokens),
        }
    print(json.dumps({k: v for k, v in result.items() if k not in workers}, indent=1))
    for name in workers:
        r = result[name]
        print(f"{name}: decode step {r['decode_step_ms_median']:.2f} ms = "
              f"{r['ratio_to_floor']:.2f}x the floor {floor:.2f} ms; "
              f"{r['torch_ops_per_step']:.0f} torch ops a step")  # fmt: skip
        for key, count, ms in r["top"]:
            print(f"    {key:40s} {count:7.1f}/step {ms:7.3f} ms/step")
    for other in ("torch", "c_attention"):
        if "c" in workers and other in workers:
            ratio = result[other]["decode_step_ms_median"] / result["c"]["decode_step_ms_median"]
            print(f"the C step is {ratio:.2f}x faster than {other}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
