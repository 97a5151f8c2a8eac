"""The engine process's host overhead per step: the real scheduler and rings, no model.

Runs the engine with the `null` executor (deterministic tokens, simulated step time 0) and
B running requests, driven by the tests' synchronous client through the real rings; measures
over N steps after a warm-up: wall time per step, the engine process's CPU time per step and
per token (from /proc), and the client's CPU time per step (reading STEP records and fanning
tokens out per request). Everything but the model, so this is the engine's own cost.

    python perf/engine_overhead.py [--batches 1,64,256,1024] [--steps N] [--json PATH]

`--compare-async R` runs each batch size R times with and without `--async-scheduling`,
interleaved, and prints the medians and their ratio; `--executor uni` runs the real model
(the default SmolLM2-135M on the CPU: give `--steps`, the defaults are for the null model).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.engine.core.ring_client import GREEDY, EngineClient  # noqa: E402 - the tests' engine client
from trillm.engine.protocol._config import EngineConfig  # noqa: E402
from trillm.gpu import WorkerConfig  # noqa: E402

STEPS = {1: 40000, 64: 8000, 256: 3000, 1024: 1000}  # about a second each, here


def process_cpu(pid: int) -> float:
    """CPU seconds of every thread of `pid` so far (schedstat: nanoseconds, not ticks)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def measure(
    model: str,
    batch: int,
    steps: int,
    warmup: int,
    *,
    executor: str = "null",
    async_scheduling: bool = False,
) -> dict[str, float]:
    worker = WorkerConfig(
        model,
        device="cpu",
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(batch * 8, 256),
        max_model_len=warmup + steps + 64,
    )
    config = EngineConfig(
        worker=worker,
        executor=executor,
        null_num_blocks=1 << 17,
        async_scheduling=async_scheduling,
    )
    client = EngineClient(config)
    try:
        for rnum in range(batch):
            client.add(rnum, [100 + rnum % 50] * 8, max_tokens=warmup + steps + 8, options=GREEDY)
        client.run_until(lambda: client.steps >= warmup)
        start_steps = client.steps
        wall, engine, mine = (
            time.perf_counter(),
            process_cpu(client.process.pid),
            time.process_time(),
        )
        client.run_until(lambda: client.steps >= start_steps + steps, timeout=600)
        wall = time.perf_counter() - wall
        engine = process_cpu(client.process.pid) - engine
        mine = time.process_time() - mine
        done = client.steps - start_steps
        client.shutdown("abort")
        client.wait_exit()
    finally:
        client.close()
    return {
        "batch": batch,
        "steps": done,
        "step_us": wall / done * 1e6,
        "engine_cpu_us_per_step": engine / done * 1e6,
        "engine_cpu_ns_per_token": engine / done / batch * 1e9,
        "client_cpu_us_per_step": mine / done * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model dir or GGUF for the config (default: SmolLM2)")
    parser.add_argument("--batches", default="1,64,256,1024")
    parser.add_argument("--steps", type=int, help="steps per batch size (default: ~1 s each)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--executor", choices=("null", "uni"), default="null")
    parser.add_argument(
        "--compare-async", type=int, metavar="R", help="R interleaved runs each, sync and async"
    )
    args = parser.parse_args()
    if args.model is None:
        from trillm.default_model import default_model_dir

        args.model = str(default_model_dir(progress=False))
    if args.compare_async:
        compare_async(args)
        return
    rows = []
    print(f"{'B':>6}{'step_us':>10}{'engine_cpu_us':>15}{'engine_ns/tok':>15}{'client_cpu_us':>15}")
    for batch in map(int, args.batches.split(",")):
        steps = args.steps or STEPS.get(batch, max(1000, 1_000_000 // max(batch, 1)))
        row = measure(args.model, batch, steps, args.warmup)
        rows.append(row)
        print(
            f"{batch:>6}{row['step_us']:>10.1f}{row['engine_cpu_us_per_step']:>15.1f}"
            f"{row['engine_cpu_ns_per_token']:>15.1f}{row['client_cpu_us_per_step']:>15.1f}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"results": rows}, indent=2) + "\n")


def compare_async(args: argparse.Namespace) -> None:
    """Each batch size R times without and with --async-scheduling, interleaved: medians of
    the wall time per step and the engine's CPU time per step, and async / sync."""
    print(
        f"{'B':>6}{'sync_step_us':>14}{'async_step_us':>15}{'ratio':>7}{'sync_cpu_us':>13}"
        f"{'async_cpu_us':>14}"
    )
    rows = []
    for batch in map(int, args.batches.split(",")):
        steps = args.steps or STEPS.get(batch, max(1000, 1_000_000 // max(batch, 1)))
        runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for _ in range(args.compare_async):
            for ahead in (False, True):
                runs[ahead].append(
                    measure(
                        args.model,
                        batch,
                        steps,
                        args.warmup,
                        executor=args.executor,
                        async_scheduling=ahead,
                    )
                )
        med = {
            (ahead, key): statistics.median(r[key] for r in runs[ahead])
            for ahead in (False, True)
            for key in ("step_us", "engine_cpu_us_per_step")
        }
        row = {"batch": batch, "executor": args.executor, "runs": args.compare_async}
        row.update({f"{'async' if a else 'sync'}_{k}": v for (a, k), v in med.items()})
        rows.append(row)
        print(
            f"{batch:>6}{med[False, 'step_us']:>14.1f}{med[True, 'step_us']:>15.1f}"
            f"{med[True, 'step_us'] / med[False, 'step_us']:>7.3f}"
            f"{med[False, 'engine_cpu_us_per_step']:>13.1f}"
            f"{med[True, 'engine_cpu_us_per_step']:>14.1f}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
