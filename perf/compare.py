"""trillm against a peer OpenAI server, side by side: same weights, same prompts, same client.

By default the peer is `transformers serve --continuous-batching` from a venv of its own
(`.venv-peer`, made on first use with the same torch and transformers versions as ours), on the
default model (SmolLM2-135M-Instruct) in float32 on the CPU. Each server runs alone, one after
the other, while `bench_serve.py` drives it at each concurrency; then the ratios are printed.

The prefill compute floor is the prompt's FLOPs (from the model's config) divided by this
machine's fp32 matmul rate, measured here with torch at the thread count the servers use: no
server can produce a first token faster than that, so TTFT at concurrency 1 is judged against it.

    python perf/compare.py [--concurrency 1,32] [--input-len 128] [--output-len 64]
    python perf/compare.py --peer-url http://gpu-box:8000 --trillm-url http://gpu-box:9000

With `--peer-url`/`--trillm-url` the servers are not started here (vLLM or SGLang on a GPU
machine: see perf/README.md); the floor is then only meaningful on the machine that serves.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import torch
from host_overhead import free_port  # perf/ is scripts: the one next to this

from trillm.gpu._cpu_linear import pack_weight, packed_linear, packed_linear_available

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def matmul_rates(threads: int) -> dict[str, float]:
    """Best fp32 GFLOP/s of square matmuls through each of torch's CPU GEMM libraries.

    MKL's sgemm (`torch.mm`) keeps to AVX2 on AMD CPUs, oneDNN uses AVX-512 where it exists:
    the machine's rate is the faster of the two.
    """
    torch.set_num_threads(threads)
    rates = {"mkl": 0.0, "onednn": 0.0}
    for n in (1024, 2048):
        a, b = torch.randn(n, n), torch.randn(n, n)
        runs: dict[str, Callable[[], object]] = {"mkl": partial(torch.mm, a, b)}
        if packed_linear_available(torch.float32):
            runs["onednn"] = partial(packed_linear, a, pack_weight(b), None)
        for name, run in runs.items():
            run()
            for _ in range(5):
                t0 = time.perf_counter()
                run()
                rates[name] = max(rates[name], 2 * n**3 / (time.perf_counter() - t0) / 1e9)
    return rates


def prompt_gflops(config: dict[str, Any], n: int) -> float:
    """GFLOPs to prefill n tokens: each linear per token, causal attention, one lm_head row."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    q = heads * head_dim
    linear = h * (q + 2 * kv) + q * h + 3 * h * config["intermediate_size"]
    attention = 2 * 2 * q * (n * (n + 1) // 2)  # q.k and p.v over the causal triangle
    return (2 * n * linear * layers + attention * layers + 2 * h * config["vocab_size"]) / 1e9


def peer_venv(path: Path) -> Path:
    """The peer's venv, made on first use: torch 2.13.0 (the CPU build on disk) and our
    transformers version, with its serving extra."""
    exe = path / "bin" / "transformers"
    if exe.exists():
        return exe
    import transformers

    print(f"compare: making {path} for transformers serve (once)", file=sys.stderr)
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, f"transformers[serving]=={transformers.__version__}"], check=True)
    return exe


@contextmanager
def serving(name: str, command: list[str], port: int, log: Path) -> Iterator[str]:
    """Run one server until its /health answers 200; stop it (SIGTERM, then SIGKILL) after."""
    base = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited during start-up; its log: {log}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} was not healthy within 300 s; its log: {log}")
            time.sleep(0.5)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def bench(base: str, args: argparse.Namespace, concurrency: int, out: Path) -> dict[str, Any]:
    """One `bench_serve.py` run in its own process (the client never shares a server's CPU)."""
    prompts = args.prompts_per_concurrency * concurrency
    command = [
        sys.executable, str(HERE / "bench_serve.py"), "--base-url", base,
        "--tokenizer", str(args.model), "--dataset", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(max(prompts, args.min_prompts)),
        "--num-warmups", str(args.num_warmups), "--max-concurrency", str(concurrency),
        "--seed", str(args.seed), "--save-result", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    result: dict[str, Any] = json.loads(out.read_text())
    return {k: v for k, v in result.items() if not isinstance(v, list)}  # aggregates only


def measure(
    name: str, url: str | None, command: list[str], port: int, args: argparse.Namespace, tmp: Path
) -> dict[int, dict[str, Any]]:
    results = {}
    with serving(name, command, port, tmp / f"{name}.log") if url is None else _given(url) as base:
        for c in args.concurrency:
            print(f"compare: {name} at concurrency {c}", file=sys.stderr, flush=True)
            results[c] = bench(base, args, c, tmp / f"{name}-{c}.json")
    return results


@contextmanager
def _given(url: str) -> Iterator[str]:
    yield url.rstrip("/")


def report(
    ours: dict[int, dict[str, Any]], peer: dict[int, dict[str, Any]], floor_ms: float
) -> list[str]:
    lines = [
        f"{'server':>8} {'c':>4} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'TPOT p99':>9} {'tokens/req':>10}",
    ]
    for name, results in (("trillm", ours), ("peer", peer)):
        for c, r in results.items():
            per_req = r["total_output_tokens"] / max(1, r["completed"])
            lines.append(
                f"{name:>8} {c:>4} {r['output_throughput']:>10.1f} {r['median_ttft_ms']:>9.1f} "
                f"{r['p99_ttft_ms']:>9.1f} {r['median_tpot_ms']:>9.1f} {r['p99_tpot_ms']:>9.1f} "
                f"{per_req:>10.1f}"
            )
    lines.append("")
    lines.append("trillm / peer:   c  out tok/s  TTFT p50  TTFT p99  TPOT p50  TPOT p99")
    for c in ours:
        ratio = [ours[c][k] / peer[c][k] if peer[c][k] else float("nan") for k in METRICS]
        lines.append(f"{'':>14}{c:>4}" + "".join(f"{x:>10.3f}" for x in ratio))
    lines.append("")
    lines.append(f"prefill compute floor: {floor_ms:.1f} ms (prompt FLOPs / best fp32 matmul rate)")
    for c in ours:
        lines.append(
            f"  c={c}: median TTFT trillm {ours[c]['median_ttft_ms']:.1f} ms = "
            f"{ours[c]['median_ttft_ms'] / floor_ms:.2f}x floor, peer "
            f"{peer[c]['median_ttft_ms']:.1f} ms = {peer[c]['median_ttft_ms'] / floor_ms:.2f}x"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="HF model dir (default: trillm's default model)")
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts-per-concurrency", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--num-warmups", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer-venv", type=Path, default=ROOT / ".venv-peer")
    p.add_argument("--peer-url", help="an already running peer (not started here)")
    p.add_argument("--trillm-url", help="an already running trillm (not started here)")
    p.add_argument("--save-result", type=Path, help="write all figures as JSON")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.model is None:
        from trillm import default_model_dir

        args.model = default_model_dir()
    config = json.loads((args.model / "config.json").read_text())
    threads = torch.get_num_threads()
    rates = matmul_rates(threads)
    rate = max(rates.values())
    gflops = prompt_gflops(config, args.input_len)
    floor_ms = gflops / rate * 1e3
    print(
        f"compare: fp32 matmul GFLOP/s on {threads} threads: "
        + ", ".join(f"{k} {v:.1f}" for k, v in rates.items())
        + f"; a {args.input_len}-token "
        f"prompt is {gflops:.2f} GFLOP -> prefill floor {floor_ms:.1f} ms",
        file=sys.stderr,
    )
    ours_port, peer_port = free_port(), free_port()
    trillm_cmd = [
        str(Path(sys.executable).parent / "trillm"), "serve", str(args.model),
        "--port", str(ours_port), "--dtype", "float32", "--device", "cpu",
    ]  # fmt: skip
    peer_cmd = [] if args.peer_url else [
        str(peer_venv(args.peer_venv)), "serve", "--continuous-batching", "--device", "cpu",
        "--dtype", "float32", "--host", "127.0.0.1", "--port", str(peer_port), str(args.model),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="trillm-compare-") as d:
        tmp = Path(d)
        ours = measure("trillm", args.trillm_url, trillm_cmd, ours_port, args, tmp)
        peer = measure("peer", args.peer_url, peer_cmd, peer_port, args, tmp)
    lines = report(ours, peer, floor_ms)
    print("\n".join(lines))
    if args.save_result:
        args.save_result.write_text(
            json.dumps(
                {
                    "matmul_gflops": rates,
                    "threads": threads,
                    "prompt_gflops": gflops,
                    "prefill_floor_ms": floor_ms,
                    "trillm": ours,
                    "peer": peer,
                    "table": lines,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
