"""Where one batch-1 decode step's time goes, against the memory-bandwidth floor.

Runs a 128-token prompt and `--new-tokens` greedy decode steps through trillm's model runner
(the built-in SmolLM2-135M, CPU), then the same under the torch profiler, and prints:
- the median decode step (ms) and the floor: the bytes one step must read (every linear
  weight once, and the LM head) over the machine's read bandwidth, a 1 GiB `torch.sum`
  measured in the same run (`model_bench.read_bandwidth`, the median of 7);
- torch ops per step and the profiler's self time grouped: linears, attention, other.

    python perf/decode_profile.py [--dtype float32] [--new-tokens 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path

import torch
from model_bench import prompts, read_bandwidth, trillm_run
from torch.profiler import profile

from trillm.gpu import Worker, WorkerConfig
from trillm.gpu._default_model import default_model_dir

LINEAR = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear")


def weight_bytes(worker: Worker) -> int:
    """Bytes one decode step reads at least: the model's own count (dense, packed for
    oneDNN or quantized; the embedding table only by row)."""
    model = worker.runner.model
    assert model is not None
    return model.decode_read_bytes()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model", help="default: the built-in SmolLM2 (its float32 conversion)")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--cpu-linear", default="auto", help="auto, onednn or aten (MKL)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    config = WorkerConfig(
        args.model or str(default_model_dir()),
        device="cpu",
        dtype=args.dtype,
        max_num_seqs=8,
        quantization=args.quantization,
        cpu_linear=args.cpu_linear,
    )
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    worker.init_kv_cache(worker.num_available_kv_blocks())
    vocab = worker.runner.model_config.vocab_size
    batch = prompts(1, args.prompt_len, vocab)
    trillm_run(worker, batch, 4)  # warm-up
    steps = [
        trillm_run(worker, batch, args.new_tokens)[1] / (args.new_tokens - 1) * 1e3
        for _ in range(args.repeats)
    ]
    bandwidth = read_bandwidth()
    floor = weight_bytes(worker) / bandwidth * 1e3
    with profile() as prof:
        trillm_run(worker, batch, args.new_tokens)
    groups: Counter[str] = Counter()
    ops = 0
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3 / args.new_tokens
        ops += event.count
        if event.key in LINEAR:
            groups["linears"] += ms
        elif "attention" in event.key or "sdpa" in event.key:
            groups["attention"] += ms
        else:
            groups["other"] += ms
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    result = {
        "dtype": args.dtype,
        "kernels": worker.kernels.describe() if worker.kernels else "",
        "threads": torch.get_num_threads(),
        "decode_step_ms_median": statistics.median(steps),
        "decode_step_ms_all": steps,
        "weight_bytes": weight_bytes(worker),
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "floor_ms": floor,
        "ratio_to_floor": statistics.median(steps) / floor,
        "torch_ops_per_step": ops / args.new_tokens,
        "self_ms_per_step": dict(groups),
    }
    print(json.dumps(result, indent=1))
    for event in top:
        print(f"{event.key:40s} {event.count / args.new_tokens:7.1f}/step "
              f"{event.self_cpu_time_total / 1e3 / args.new_tokens:7.3f} ms/step")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
