"""Top-k / top-p without a sort (`lib/gpu/sample/_sampler.py`) against the full-vocabulary sort.

For each batch size B and vocabulary V, times the old sort-based filter (kept here as the
baseline) and the sampler's filter on the same logits (randn * 3, temperature 1), with:

- `top_p`: top_p 0.9, top_k off: the sort against bisection on the threshold (30 passes);
- `top_k+top_p`: top_k 50, top_p 0.9: the sort against a prefix sum over topk(50);
- `greedy`: torch's `max(dim=-1).indices` (the "sort" column) against the sampler's
  `_greedy` (numpy's argmax on the CPU).

Runs are interleaved so both see the same machine state; medians of `--repeats`. On CUDA
each timing waits for the device (`torch.cuda.synchronize`) before it stops.

    .venv/bin/python perf/sampler_bench.py [--batch 1,32,256] [--vocab 49152,128256]
        [--device cpu|cuda] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The baseline: the sampler's filter before it stopped sorting (the tests' reference, too).
from tests.gpu.test_sampler import sorted_top_k_top_p as sort_top_k_top_p
from trillm.common.wire import SamplingOptions
from trillm.gpu.sample._sampler import _apply_top_k_top_p, _greedy
from trillm.gpu.sample._sampling_batch import RequestSamplingState, SamplingBatch


def median_ms(
    runs: dict[str, Callable[[], object]], repeats: int, device: torch.device
) -> dict[str, float]:
    def wait() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            wait()
            start = time.perf_counter()
            run()
            wait()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,32,256")
    parser.add_argument("--vocab", default="49152,128256")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
        f"float32 logits on {device}"
    )
    print(f"{'case':<12} {'B':>4} {'V':>7} {'sort ms':>9} {'new ms':>9} {'new/sort':>9}")
    for vocab in (int(v) for v in args.vocab.split(",")):
        for batch in (int(b) for b in args.batch.split(",")):
            logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 3
            logits = logits.to(device)
            greedy = {"sort": partial(torch.max, logits, -1), "new": partial(_greedy, logits)}
            times = median_ms(greedy, args.repeats, device)
            print(
                f"{'greedy':<12} {batch:>4} {vocab:>7} {times['sort']:>9.2f} {times['new']:>9.2f} "
                f"{times['new'] / times['sort']:>9.3f}"
            )
            for case, options in (
                ("top_p", SamplingOptions(top_p=0.9)),
                ("top_k+top_p", SamplingOptions(top_k=50, top_p=0.9)),
            ):
                state = RequestSamplingState(options, np.zeros(0, np.int32), device)
                built = SamplingBatch.build(
                    [state] * batch, eos_token_id=None, vocab_size=vocab, device=device
                )
                random = built.random
                if random is None or random.top_p is None:
                    raise SystemExit(f"{case}: the batch has no top-p rows; fix the options")
                runs: dict[str, Callable[[], object]] = {
                    "sort": partial(sort_top_k_top_p, logits, random.top_k, random.top_p),
                    "new": partial(_apply_top_k_top_p, logits, random.top_p, random),
                }
                times = median_ms(runs, args.repeats, device)
                print(
                    f"{case:<12} {batch:>4} {vocab:>7} {times['sort']:>9.2f} {times['new']:>9.2f} "
                    f"{times['new'] / times['sort']:>9.3f}"
                )


if __name__ == "__main__":
    main()
