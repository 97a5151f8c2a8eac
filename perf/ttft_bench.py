"""TTFT at concurrency 1 against the in-process prefill forward of the same prompt.

What the server adds to a first token: HTTP, admission, the request ring, scheduling, the
step's inputs, sampling, the STEP record, the output pump, detokenising and the SSE write.
Measured side by side in one run: the model runner's prefill step of a P-token prompt
(in this process, the same model, dtype and threads as the server's engine) and the
client-side TTFT of `trillm serve` streaming the same prompt ids (max_tokens 1), one sample
of each in turn so both see the same machine. Prefix caching is off in the server, or every
repeat after the first would reuse the prompt's blocks.

    python perf/ttft_bench.py [--prompt-len 128] [--repeats 15] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from compare import serving  # perf/ is scripts: the ones next to this
from host_overhead import free_port
from model_bench import prompts, trillm_run

from trillm.default_model import default_model_dir
from trillm.gpu import Worker, WorkerConfig


def first_token_s(client: httpx.Client, base: str, ids: list[int]) -> float:
    """Seconds from sending a streamed completion of `ids` to its first token's event."""
    body = {"prompt": ids, "max_tokens": 1, "stream": True, "temperature": 0.0}
    start = time.perf_counter()
    with client.stream("POST", f"{base}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError("the stream ended without a token")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", type=Path)
    p.add_argument("serve_args", nargs="*", help="more `trillm serve` arguments, after --")
    args = p.parse_args()
    model = str(default_model_dir())
    worker = Worker(WorkerConfig(model, device="cpu", dtype=args.dtype, max_num_seqs=8))
    worker.init_device()
    worker.load_model()
    worker.init_kv_cache(worker.num_available_kv_blocks())
    vocab = worker.runner.model_config.vocab_size
    port = free_port()
    command = [
        sys.executable, "-m", "trillm.cli", "serve", model, "--port", str(port),
        "--dtype", args.dtype, "--no-enable-prefix-caching", *args.serve_args,
    ]  # fmt: skip
    forward: list[float] = []
    ttft: list[float] = []
    log = Path(tempfile.gettempdir()) / f"trillm-ttft-bench-{port}.log"
    with serving("trillm", command, port, log) as base, httpx.Client(timeout=120) as client:
        for i in range(args.repeats + 2):  # the first two of each warm up
            ids = prompts(1, args.prompt_len, vocab)[0]
            ids[0] = 100 + i  # a new prompt each time
            step = trillm_run(worker, [ids], 1)[0]
            first = first_token_s(client, base, ids)
            if i >= 2:
                forward.append(step)
                ttft.append(first)
    f, t = statistics.median(forward) * 1e3, statistics.median(ttft) * 1e3
    result = {
        "prompt_len": args.prompt_len,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "prefill_forward_ms_median": f,
        "ttft_ms_median": t,
        "ratio": t / f,
        "server_overhead_ms": t - f,
        "prefill_forward_ms": [x * 1e3 for x in forward],
        "ttft_ms": [x * 1e3 for x in ttft],
    }
    print(
        f"{args.prompt_len}-token prompt, {args.repeats} of each, interleaved: prefill forward "
        f"{f:.1f} ms, TTFT at c=1 {t:.1f} ms: {t / f:.2f}x ({t - f:+.1f} ms)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
