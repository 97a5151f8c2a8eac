"""The model runner's host work per decode step, without the model: this tree against a base.

`ModelRunner.execute` runs with the forward and the logits replaced by fixed tensors (a tiny
random Llama, vocabulary 1024, on the CPU, one thread), so what is timed is the host side of
a step: forgetting and adding requests, the rows' lookup, the flattened inputs, prompt
logprobs, the sampling batch, the sampler over tiny logits, the appends. Each case: B
requests decoding (8-token prompts), `--steps` steps timed one by one, the median.

`--base REF` extracts `lib/` at git REF (`git archive`, nothing in the repository changes)
and runs the same cases on it in alternating subprocesses, round by round, so both sides
see the same machine load; medians over rounds and the ratio this tree / base.

    .venv/bin/python perf/runner_host_bench.py [--base REF] [--batches 1,32]
        [--rounds 5] [--steps 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CASES = ("greedy", "temperature", "temperature+logprobs")


def _import_trillm(lib: Path) -> None:
    """Make `import trillm` load `lib` (a base tree) instead of the installed one."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "trillm", lib / "__init__.py", submodule_search_locations=[str(lib)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["trillm"] = module
    spec.loader.exec_module(module)


def measure(batch: int, case: str, steps: int) -> float:
    """Median microseconds of `execute` per decode step for `batch` requests of `case`."""
    import numpy as np
    import torch

    from trillm.common.wire import SamplingOptions
    from trillm.gpu import ModelRunner, TensorParallel, WorkerConfig, open_model
    from trillm.gpu._step_batch import NewRequest, StepBatch

    sys.path.insert(0, str(ROOT / "perf"))
    from gpu_bench import TINY, llama_config, write_model_dir

    torch.set_num_threads(1)
    prompt, block = 8, 16
    per_request = -(-(prompt + steps + 16) // block)
    with tempfile.TemporaryDirectory(prefix="runner-host-") as tmp:
        model_dir = write_model_dir(Path(tmp), llama_config(TINY))
        config = WorkerConfig(
            str(model_dir),
            load_format="dummy",
            device="cpu",
            block_size=block,
            max_num_seqs=max(batch, 1),
            max_num_batched_tokens=max(batch * prompt, 256),
            max_model_len=per_request * block,
        )
        model_config, weights = open_model(config.model, config.load_format)
        runner = ModelRunner(config, model_config, TensorParallel(), torch.device("cpu"))
        runner.load_model(weights)
        runner.init_kv_cache(batch * per_request + 1)
    vocab = model_config.vocab_size
    hidden = torch.zeros(batch * prompt, model_config.hidden_size)
    logits = torch.randn(batch * prompt, vocab, generator=torch.Generator().manual_seed(0))
    runner._forward = lambda path, inputs, embeds: hidden[: len(inputs.input_ids)]  # type: ignore[method-assign]
    for owner in (runner.model, runner.cpu_step):
        if owner is not None:
            owner.compute_logits = lambda h: logits[: h.shape[0]]  # type: ignore[method-assign]
    options = {
        "greedy": SamplingOptions(temperature=0.0),
        "temperature": SamplingOptions(temperature=0.8),
        "temperature+logprobs": SamplingOptions(temperature=0.8, logprobs=2),
    }[case]
    rnums = np.arange(batch, dtype=np.uint64) + 1000
    new = [
        NewRequest(
            int(r),
            [100 + i] * prompt,
            list(range(i * per_request, (i + 1) * per_request)),
            0,
            options,
        )
        for i, r in enumerate(rnums.tolist())
    ]
    runner.execute(
        StepBatch(
            0,
            new_requests=new,
            scheduled_rnums=rnums,
            num_scheduled_tokens=np.full(batch, prompt, np.int32),
        )
    )
    times = []
    for step in range(1, steps + 1):
        computed = np.full(batch, prompt + step - 1, np.int32)
        decode = StepBatch(
            step,
            cached_rnums=rnums,
            cached_new_block_ids=[[] for _ in range(batch)],
            cached_num_computed=computed,
            scheduled_rnums=rnums,
            num_scheduled_tokens=np.ones(batch, np.int32),
        )
        start = time.perf_counter()
        runner.execute(decode)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _child(args: argparse.Namespace) -> None:
    if args.lib:
        _import_trillm(Path(args.lib))
    result = {f"{case} B={b}": measure(b, case, args.steps) for b in args.batches for case in CASES}
    print(json.dumps(result))


def _run_side(lib: Path | None, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", "--steps", str(args.steps)]
    command += ["--batches", ",".join(map(str, args.batches))]
    if lib is not None:
        command += ["--lib", str(lib)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="git ref whose lib/ is the baseline (none: this tree only)")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", type=Path, metavar="PATH")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lib", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batches = [int(b) for b in str(args.batches).split(",")]
    if args.child:
        _child(args)
        return
    with tempfile.TemporaryDirectory(prefix="runner-host-base-") as tmp:
        base_lib = None
        if args.base:
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", args.base, "lib"],
                check=True,
                capture_output=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            base_lib = Path(tmp) / "lib"
        sides: dict[str, list[dict[str, float]]] = {"this tree": [], "base": []}
        for _ in range(args.rounds):
            sides["this tree"].append(_run_side(None, args))
            if base_lib is not None:
                sides["base"].append(_run_side(base_lib, args))
    load = os.getloadavg()
    rows: dict[str, dict[str, float]] = {}
    print(f"host us per decode step, medians of {args.rounds} rounds x {args.steps} steps;")
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'case':<28} {'this tree':>10} {'base':>10} {'ratio':>7}")
    for key in sides["this tree"][0]:
        mine = statistics.median(r[key] for r in sides["this tree"])
        base = statistics.median(r[key] for r in sides["base"]) if sides["base"] else None
        ratio = mine / base if base else None
        rows[key] = {"this_tree_us": mine} | ({"base_us": base, "ratio": ratio} if base else {})
        print(
            f"{key:<28} {mine:>10.1f} {base if base is not None else float('nan'):>10.1f} "
            f"{ratio if ratio is not None else float('nan'):>7.2f}"
        )
    if args.json:
        record: dict[str, Any] = {
            "base": args.base,
            "rounds": args.rounds,
            "steps": args.steps,
            "loadavg": load,
            "cases": rows,
        }
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
