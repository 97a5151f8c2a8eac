"""Prefill and decode tokens/s of trillm's model runner against transformers, same machine.

For each dtype and batch size B, both generate N tokens greedily for B prompts of P tokens
(no EOS stop): trillm through a `Worker` driven step by step (all prompts prefilled in the
first step, then one decode step per token), transformers through `generate` (its prefill is
timed as `generate(max_new_tokens=1)`, its decode as the rest). Medians of `--repeats` runs.

With `--quantization none,gguf` (a list) trillm runs once per setting on the same GGUF file
(the built-in SmolLM2 Q4_1 file by default), the settings interleaved run by run, against the
first setting instead of transformers; it also prints each setting's bandwidth floor: the
bytes of its weights over this machine's read bandwidth (a 1 GiB `torch.sum`).

    python perf/model_bench.py [--model DIR] [--batches 1,8,32] [--dtypes float32,bfloat16]
    python perf/model_bench.py --quantization none,gguf [--model FILE.gguf] [--batches 1,32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.gpu.driver import Driver, DriverRequest  # noqa: E402 - the runner's minimal driver
from trillm.gpu import SamplingOptions, Worker, WorkerConfig  # noqa: E402


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(100, vocab - 1, (batch, length), generator=g).tolist()


def trillm_run(worker: Worker, batch: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """Seconds for the prefill step and for the decode steps."""
    blocks = worker.runner.kv_caches[0][0].shape[0]
    driver = Driver(worker.runner, blocks)
    greedy = SamplingOptions(temperature=0.0)
    requests = [DriverRequest(i, p, new_tokens, greedy) for i, p in enumerate(batch)]
    times: list[float] = []
    execute = worker.runner.execute

    def timed(step_batch: Any) -> Any:
        start = time.perf_counter()
        out = execute(step_batch)
        times.append(time.perf_counter() - start)
        return out

    worker.runner.execute = timed  # type: ignore[method-assign]
    try:
        driver.run(requests)
    finally:
        worker.runner.execute = execute  # type: ignore[method-assign]
    return times[0], sum(times[1:])


def hf_run(model: Any, batch: list[list[int]], new_tokens: int) -> tuple[float, float]:
    ids = torch.tensor(batch)
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - start
    return prefill, max(total - prefill, 1e-9)


def read_bandwidth(repeats: int = 7) -> float:
    """Bytes per second a `torch.sum` of 1 GiB of float32 reads (the median of `repeats`)."""
    data = torch.ones(1 << 28)
    data.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times)


def quantization_main(args: argparse.Namespace) -> None:
    """Each `--quantization` setting on the same GGUF file, interleaved, against the first."""
    if args.model is None:
        from trillm.gpu._default_model import find_default_gguf

        args.model = str(find_default_gguf())
    settings = args.quantization.split(",")
    rows = []
    bandwidth = read_bandwidth()
    print(f"read bandwidth (1 GiB torch.sum): {bandwidth / 1e9:.1f} GB/s", flush=True)
    for dtype in args.dtypes.split(","):
        workers = {}
        for q in settings:
            config = WorkerConfig(
                args.model, device="cpu", dtype=dtype, max_num_seqs=64, quantization=q
            )
            worker = workers[q] = Worker(config)
            worker.init_device()
            worker.load_model()
            worker.init_kv_cache(worker.num_available_kv_blocks())
            assert worker.runner.model is not None
            model = worker.runner.model
            read = model.decode_read_bytes()
            print(
                f"{dtype:<9} {q:<5} {worker.kernels.describe()}\n"
                f"{'':15} weights {model.weight_bytes() / 1e6:.1f} MB, {read / 1e6:.1f} MB "
                f"read a decode step: floor {read / bandwidth * 1e3:.1f} ms",
                flush=True,
            )
        vocab = next(iter(workers.values())).runner.model_config.vocab_size
        for b in map(int, args.batches.split(",")):
            batch = prompts(b, args.prompt_len, vocab)
            for worker in workers.values():
                trillm_run(worker, batch, 2)  # warm-up
            runs: dict[str, list[tuple[float, float]]] = {q: [] for q in settings}
            for _ in range(args.repeats):
                for q, worker in workers.items():
                    runs[q].append(trillm_run(worker, batch, args.new_tokens))
            steps = args.new_tokens - 1
            base_prefill = statistics.median(t[0] for t in runs[settings[0]])
            base_decode = statistics.median(t[1] for t in runs[settings[0]])
            for q in settings:
                prefill = statistics.median(t[0] for t in runs[q])
                decode = statistics.median(t[1] for t in runs[q])
                rows.append(
                    {
                        "dtype": dtype,
                        "quantization": q,
                        "batch": b,
                        "prefill_ms": prefill * 1e3,
                        "decode_step_ms": decode / steps * 1e3,
                        "prefill_tok_s": b * args.prompt_len / prefill,
                        "decode_tok_s": b * steps / decode,
                    }
                )
                print(
                    f"{dtype:<9} {q:<5} B={b:<3} prefill {prefill * 1e3:8.1f} ms "
                    f"(x{base_prefill / prefill:.2f})  decode step {decode / steps * 1e3:7.2f} ms "
                    f"(x{base_decode / decode:.2f}), {b * steps / decode:7.1f} tok/s",
                    flush=True,
                )
    write_json(args, rows, read_bandwidth_gb_s=bandwidth / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face model dir (default: the built-in SmolLM2)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--quantization",
        help="compare trillm's --quantization settings on one GGUF file (e.g. none,gguf; "
        "the first is the baseline) instead of trillm against transformers",
    )
    args = parser.parse_args()
    if args.quantization is not None:
        quantization_main(args)
        return
    if args.model is None:
        from trillm.gpu._default_model import default_model_dir

        args.model = str(default_model_dir())
    rows = []
    for dtype in args.dtypes.split(","):
        worker = Worker(WorkerConfig(args.model, device="cpu", dtype=dtype, max_num_seqs=64))
        worker.init_device()
        worker.load_model()
        worker.init_kv_cache(worker.num_available_kv_blocks())
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            args.model, dtype=getattr(torch, dtype)
        ).eval()
        vocab = worker.runner.model_config.vocab_size
        for b in map(int, args.batches.split(",")):
            batch = prompts(b, args.prompt_len, vocab)
            trillm_run(worker, batch, 2)  # warm-up
            hf_run(hf, batch, 2)
            ours = [trillm_run(worker, batch, args.new_tokens) for _ in range(args.repeats)]
            theirs = [hf_run(hf, batch, args.new_tokens) for _ in range(args.repeats)]
            decoded = b * (args.new_tokens - 1)
            row = {
                "dtype": dtype,
                "batch": b,
                "prefill_tok_s": b * args.prompt_len / statistics.median(t[0] for t in ours),
                "hf_prefill_tok_s": b * args.prompt_len / statistics.median(t[0] for t in theirs),
                "decode_tok_s": decoded / statistics.median(t[1] for t in ours),
                "hf_decode_tok_s": decoded / statistics.median(t[1] for t in theirs),
            }
            rows.append(row)
            prefill_x = row["prefill_tok_s"] / row["hf_prefill_tok_s"]
            decode_x = row["decode_tok_s"] / row["hf_decode_tok_s"]
            print(
                f"{dtype:<9} B={b:<3} prefill {row['prefill_tok_s']:8.0f} tok/s "
                f"(transformers {row['hf_prefill_tok_s']:8.0f}, x{prefill_x:.2f})  "
                f"decode {row['decode_tok_s']:7.1f} tok/s "
                f"(transformers {row['hf_decode_tok_s']:7.1f}, x{decode_x:.2f})",
                flush=True,
            )
    write_json(args, rows)


def write_json(args: argparse.Namespace, rows: list[dict[str, Any]], **extra: float) -> None:
    """The run's settings and rows to `--json`, if given."""
    if args.json:
        run = {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens, **extra}
        Path(args.json).write_text(json.dumps({**run, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
