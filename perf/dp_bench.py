"""Data parallelism: does serving throughput grow with the number of engines?

Three parts, medians over the repeats; the first two start their servers side by side and
measure them interleaved (N=1, N=2, N=1, N=2, ...):

- null: `trillm serve --executor null --null-step-time T --max-num-seqs S -dp N` under
  `bench_serve.py` at a concurrency above N * S. A step takes T seconds whatever it holds, so
  an engine streams at most S tokens per T and N engines should stream N times as many.
- model: the default model (SmolLM2-135M, float32, CPU) at N=1, N=2, and N=2 with
  `OMP_NUM_THREADS=1` in the server's environment. The uniproc engines never set torch's
  thread count, so each takes one thread per core; with two engines on two cores that is
  twice as many compute threads as cores. The run says how busy the cores were, how many
  threads each engine ran on, and how long the engines' threads waited for a core.
- probe: no server; the decode step's linears in 1 or 2 processes at once, by thread count
  and OpenMP wait policy: the engines' threading on these cores, without trillm around it.

Each engine's share of the requests comes from /metrics (`prefix_cache_queries{engine=...}`
over the prompt length: tokens looked up once per admitted request), its steps from
`engine_steps{engine=...}`; CPU and run-queue wait per process from /proc/<pid>/task/*/schedstat.

    python perf/dp_bench.py [--repeats 3] [--skip-null] [--skip-model] [--skip-probe] \
        [--json perf/results/dp_bench.json] [--txt perf/results/dp_bench.txt]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench_serve siblings

import bench_serve
import httpx
from _bench_cli import parse_args
from _bench_client import ClientConfig
from _bench_datasets import load_tokenizer
from host_overhead import children, free_port

TRILLM = str(Path(sys.executable).parent / "trillm")
REPORTED = (
    "output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms",
    "median_tpot_ms", "p99_tpot_ms",
)  # fmt: skip
_SERIES = re.compile(r"^([\w:]+)(?:\{(.*)\})? (\S+)$")
_ENGINE = re.compile(r'engine="(\d+)"')


@dataclass(frozen=True)
class Setup:
    """One server under test: its name in the report, its engines, flags and environment."""

    name: str
    dp: int
    flags: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Server:
    setup: Setup
    base_url: str
    pid: int
    engines: list[int]  # pids, in spawn order (= engine index)
    model: str = ""


# -- servers ----------------------------------------------------------------------------------


@contextmanager
def serving(setups: list[Setup], logs: Path) -> Iterator[list[Server]]:
    """Start every server at once, wait until each answers /health; stop them all after."""
    with ExitStack() as stack:
        started = []
        for setup in setups:
            port = free_port()
            log = stack.enter_context(open(logs / f"{setup.name}.log", "wb"))
            command = [TRILLM, "serve", "--port", str(port), "-dp", str(setup.dp), *setup.flags]
            command += ["--max-api-restarts", "0"]  # the pid is the API server's: its children
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=os.environ | setup.env
            )
            stack.callback(_stop, process)
            started.append((setup, process, f"http://127.0.0.1:{port}"))
        servers = []
        for setup, process, base in started:
            _wait_healthy(process, base, logs / f"{setup.name}.log")
            engines = sorted(children(process.pid))
            if len(engines) != setup.dp:
                raise RuntimeError(f"{setup.name}: {len(engines)} engine processes, not {setup.dp}")
            server = Server(setup, base, process.pid, engines)
            server.model = bench_serve.first_model(base, None)
            servers.append(server)
        yield servers


def _wait_healthy(process: subprocess.Popen[bytes], base: str, log: Path) -> None:
    deadline = time.monotonic() + 300
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited during start-up; its log ends:\n{_tail(log)}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not healthy within 300 s; its log:\n{_tail(log)}")
        time.sleep(0.3)


def _tail(log: Path) -> str:
    """The end of a server's log (the logs' folder is gone once the run ends)."""
    return log.read_text(errors="replace")[-3000:]


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# -- what the server and /proc say ------------------------------------------------------------


def engine_counters(base: str) -> dict[str, list[float]]:
    """Per-engine counters from /metrics: {name: [engine 0, engine 1, ...]} (empty lists if
    the server has no `engine` label)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    out: dict[str, dict[int, float]] = {}
    for line in text.splitlines():
        match = _SERIES.match(line)
        if not match or match.group(1) not in (
            "trillm:engine_steps_total", "trillm:prefix_cache_queries_total",
        ):  # fmt: skip
            continue
        engine = _ENGINE.search(match.group(2) or "")
        if engine:
            out.setdefault(match.group(1), {})[int(engine.group(1))] = float(match.group(3))
    return {name: [v for _, v in sorted(by.items())] for name, by in out.items()}


def threads(pid: int) -> dict[int, tuple[int, int, int]]:
    """{tid: (run ns, run-queue wait ns, involuntary context switches)} of a live process."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run, wait, _ = (int(x) for x in f.read().split())
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                switches = int(re.search(r"nonvoluntary_ctxt_switches:\s+(\d+)", f.read())[1])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
        out[int(tid)] = (run, wait, switches)
    return out


def process_delta(before: dict[int, tuple[int, int, int]], pid: int, wall: float) -> dict[str, Any]:
    """CPU seconds, run-queue wait seconds, involuntary switches and busy threads (those
    that ran for over 10 % of the wall time) of one process since `before`."""
    after = threads(pid)
    deltas = [
        tuple(a - b for a, b in zip(now, before.get(tid, (0, 0, 0)), strict=True))
        for tid, now in after.items()
    ]
    return {
        "cpu_s": sum(d[0] for d in deltas) / 1e9,
        "runq_wait_s": sum(d[1] for d in deltas) / 1e9,
        "nonvoluntary_switches": sum(d[2] for d in deltas),
        "busy_threads": sum(d[0] / 1e9 > 0.1 * wall for d in deltas),
        "threads": len(after),
    }


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all cores, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


# -- one measured run -------------------------------------------------------------------------


def bench_args(load: dict[str, int], seed: int) -> argparse.Namespace:
    return parse_args([
        "--dataset", "random", "--prompt-format", "ids", "--ignore-eos",
        "--random-input-len", str(load["input_len"]),
        "--random-output-len", str(load["output_len"]),
        "--num-prompts", str(load["num_prompts"]), "--max-concurrency", str(load["concurrency"]),
        "--seed", str(seed),
    ])  # fmt: skip


def measure(server: Server, tokenizer: Any, load: dict[str, int], seed: int) -> dict[str, Any]:
    """One `bench_serve` run against `server`, with the engines' and processes' figures."""
    args = bench_args(load, seed)
    samples = bench_serve.build_samples(args, tokenizer)
    config = ClientConfig(server.base_url, server.model, "completions", ignore_eos=True)
    pids = [server.pid, *server.engines]
    counters0 = engine_counters(server.base_url)
    procs0 = {pid: threads(pid) for pid in pids}
    busy0, total0 = machine_ticks()
    wall0 = time.perf_counter()
    metrics = asyncio.run(bench_serve.benchmark(config, args, samples, tokenizer))["metrics"]
    wall = time.perf_counter() - wall0
    busy1, total1 = machine_ticks()
    procs = {pid: process_delta(procs0[pid], pid, wall) for pid in pids}
    counters = engine_counters(server.base_url)
    delta = {k: [b - a for a, b in zip(counters0[k], v, strict=True)] for k, v in counters.items()}
    queries = delta.get("trillm:prefix_cache_queries_total", [])
    row = {k: metrics[k] for k in (*REPORTED, "completed", "failed", "total_output_tokens")}
    return row | {
        "client_cpu_fraction": metrics["client_cpu_fraction"],
        "wall_s": wall,
        "cores_busy": (busy1 - busy0) / max(total1 - total0, 1) * len(os.sched_getaffinity(0)),
        "engine_requests": [q / load["input_len"] for q in queries],
        "engine_steps": delta.get("trillm:engine_steps_total", []),
        "frontend": procs[server.pid],
        "engines": [procs[pid] for pid in server.engines],
    }


def run_part(
    setups: list[Setup], load: dict[str, int], tokenizer: Any, repeats: int, seed: int, logs: Path
) -> dict[str, list[dict[str, Any]]]:
    """Each setup's runs: one short discarded warm-up each (the first forwards and requests
    after a start are slow), then `repeats` rounds, interleaved.
    Round r sends every server the same prompts (seed + r); no round repeats a prompt, so
    no prefix cache or routing memory carries over from one round to the next."""
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in setups}
    with serving(setups, logs) as servers:
        warm = load | {"num_prompts": load["concurrency"], "output_len": 8}
        for server in servers:
            measure(server, tokenizer, warm, seed + 1000)
        for r in range(repeats):
            for server in servers:
                run = measure(server, tokenizer, load, seed + r)
                runs[server.setup.name].append(run)
                print(
                    f"dp_bench: {server.setup.name} round {r + 1}: "
                    f"{run['output_throughput']:.1f} tok/s in {run['wall_s']:.1f} s, "
                    f"cores busy {run['cores_busy']:.2f}, load average {os.getloadavg()[0]:.1f}",
                    file=sys.stderr,
                    flush=True,
                )
    return runs


# -- the report -------------------------------------------------------------------------------


def median(runs: list[dict[str, Any]], get: Any) -> float:
    return statistics.median(get(r) for r in runs)


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats, per engine where a figure is per engine."""
    n = len(runs[0]["engines"])
    out: dict[str, Any] = {k: median(runs, lambda r, k=k: r[k]) for k in REPORTED}
    for key in ("engine_requests", "engine_steps"):
        if runs[0][key]:
            out[key] = [median(runs, lambda r, i=i, key=key: r[key][i]) for i in range(n)]
    engines = [r["engines"] for r in runs]
    ours = [
        r["client_cpu_fraction"]
        + (r["frontend"]["cpu_s"] + sum(e["cpu_s"] for e in es)) / r["wall_s"]
        for es, r in zip(engines, runs, strict=True)
    ]
    out |= {
        "other_cpu_per_s": statistics.median(
            r["cores_busy"] - o for r, o in zip(runs, ours, strict=True)
        ),
        "cores_busy": median(runs, lambda r: r["cores_busy"]),
        "client_cpu_fraction": median(runs, lambda r: r["client_cpu_fraction"]),
        "failed": sum(r["failed"] for r in runs),
        "frontend_cpu_per_s": median(runs, lambda r: r["frontend"]["cpu_s"] / r["wall_s"]),
        "engine_cpu_per_s": statistics.median(
            sum(e["cpu_s"] for e in es) / r["wall_s"] for es, r in zip(engines, runs, strict=True)
        ),
        "engine_runq_wait_per_s": statistics.median(
            sum(e["runq_wait_s"] for e in es) / r["wall_s"]
            for es, r in zip(engines, runs, strict=True)
        ),
        "engine_switches_per_s": statistics.median(
            sum(e["nonvoluntary_switches"] for e in es) / r["wall_s"]
            for es, r in zip(engines, runs, strict=True)
        ),
        "busy_threads_per_engine": [
            statistics.median(es[i]["busy_threads"] for es in engines) for i in range(n)
        ],
    }
    return out


def table(title: str, sums: dict[str, dict[str, Any]], baseline: str) -> list[str]:
    lines = [
        title,
        f"{'setup':<8}{'out tok/s':>10}{'req/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'TPOT p50':>10}{'TPOT p99':>10}  requests/engine  steps/engine",
    ]
    for name, s in sums.items():
        reqs = "/".join(f"{x:.0f}" for x in s.get("engine_requests", [])) or "-"
        steps = "/".join(f"{x:.0f}" for x in s.get("engine_steps", [])) or "-"
        lines.append(
            f"{name:<8}{s['output_throughput']:>10.1f}{s['request_throughput']:>8.2f}"
            f"{s['median_ttft_ms']:>10.1f}{s['p99_ttft_ms']:>10.1f}{s['median_tpot_ms']:>10.1f}"
            f"{s['p99_tpot_ms']:>10.1f}  {reqs:>15}  {steps:>12}"
        )
    lines.append(
        f"{'':<8}{'cores busy':>11}{'other':>7}{'client':>8}{'frontend':>10}{'engines':>9}"
        f"{'runq wait':>11}{'switches/s':>12}  busy threads/engine  failed"
    )
    for name, s in sums.items():
        busy = "/".join(f"{x:.0f}" for x in s["busy_threads_per_engine"])
        lines.append(
            f"{name:<8}{s['cores_busy']:>11.2f}{s['other_cpu_per_s']:>7.2f}"
            f"{s['client_cpu_fraction']:>8.2f}"
            f"{s['frontend_cpu_per_s']:>10.2f}{s['engine_cpu_per_s']:>9.2f}"
            f"{s['engine_runq_wait_per_s']:>11.2f}{s['engine_switches_per_s']:>12.0f}"
            f"  {busy:>19}  {s['failed']:>6}"
        )
    base = sums[baseline]
    for name, s in sums.items():
        if name == baseline:
            continue
        ratios = "  ".join(
            f"{k.replace('_throughput', '').replace('_ms', '')} {s[k] / base[k]:.3f}"
            for k in REPORTED
            if base[k]
        )
        lines.append(f"{name} / {baseline}: {ratios}")
    return lines


def torch_threads(env: dict[str, str]) -> int:
    """`torch.get_num_threads()` of a fresh interpreter with this environment: what a uniproc
    engine runs with, since it never sets the count (only multiproc ranks do)."""
    code = "import torch; print(torch.get_num_threads())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=os.environ | env, capture_output=True, check=True
    )
    return int(out.stdout)


# The probe's child: SmolLM2-135M's 30 layers of linears (qkv, o, gate/up, down) at 8 tokens,
# a decode step's GEMMs, through F.linear (MKL; the engines use oneDNN: both thread with the
# same OpenMP runtime), as many times as fit in the given seconds.
_PROBE = """
import json, sys, time, torch
F = torch.nn.functional
layers = [(torch.randn(960, 576), torch.randn(576, 576), torch.randn(3072, 576),
           torch.randn(576, 1536)) for _ in range(30)]
x = torch.randn(8, 576)
def forward():
    for qkv, o, gate_up, down in layers:
        F.linear(x, qkv); F.linear(x, o); F.linear(F.linear(x, gate_up)[:, :1536], down)
forward()
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < float(sys.argv[1]):
    forward(); n += 1
print(json.dumps({"forwards_per_s": n / (time.perf_counter() - t0)}))
"""
PROBE_CASES = (
    ("1 proc x 2 threads", 1, {}),
    ("1 proc x 1 thread", 1, {"OMP_NUM_THREADS": "1"}),
    ("2 procs x 2 threads", 2, {}),
    ("2 procs x 1 thread", 2, {"OMP_NUM_THREADS": "1"}),
    ("2 procs x 2 threads, passive", 2, {"OMP_WAIT_POLICY": "PASSIVE"}),
)


def thread_probe(repeats: int, seconds: float) -> dict[str, Any]:
    """Forwards/s of the probe in 1 or 2 processes at once, by thread count and OpenMP wait
    policy, with no server: what the engines' threading alone does to these cores."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in PROBE_CASES}
    for _ in range(repeats):
        for name, procs, env in PROBE_CASES:
            busy0, total0 = machine_ticks()
            workers = [
                subprocess.Popen(
                    [sys.executable, "-c", _PROBE, str(seconds)],
                    env=os.environ | env,
                    stdout=subprocess.PIPE,
                )
                for _ in range(procs)
            ]
            rates = [json.loads(c.communicate()[0])["forwards_per_s"] for c in workers]
            busy1, total1 = machine_ticks()
            cores = (busy1 - busy0) / max(total1 - total0, 1) * len(os.sched_getaffinity(0))
            runs[name].append({"forwards_per_s": sum(rates), "cores_busy": cores})
    return {
        name: {
            "forwards_per_s": statistics.median(r["forwards_per_s"] for r in rs),
            "cores_busy": statistics.median(r["cores_busy"] for r in rs),
            "runs": rs,
        }
        for name, rs in runs.items()
    }


def probe_table(probe: dict[str, Any], seconds: float) -> list[str]:
    base = probe[PROBE_CASES[0][0]]["forwards_per_s"]
    lines = [
        f"threads probe, no server: SmolLM2-135M's linears at 8 tokens, {seconds:g} s per case, "
        "all processes at once",
        f"{'case':<32}{'forwards/s':>11}{'vs 1x2':>8}{'cores busy':>12}",
    ]
    for name, r in probe.items():
        lines.append(
            f"{name:<32}{r['forwards_per_s']:>11.1f}{r['forwards_per_s'] / base:>8.2f}"
            f"{r['cores_busy']:>12.2f}"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--model-concurrency", type=int, default=8)
    p.add_argument("--model-num-prompts", type=int, default=16)
    p.add_argument("--model-input-len", type=int, default=64)
    p.add_argument("--model-output-len", type=int, default=32)
    p.add_argument("--skip-null", action="store_true")
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--skip-probe", action="store_true")
    p.add_argument("--probe-seconds", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write every run and the medians as JSON")
    p.add_argument("--txt", type=Path, help="write the report as text")
    args = p.parse_args()

    from trillm.default_model import default_model_dir

    model_dir = default_model_dir()
    tokenizer = load_tokenizer(str(model_dir))
    result: dict[str, Any] = {"cores": len(os.sched_getaffinity(0))}
    lines = [f"dp_bench: {result['cores']} cores, {args.repeats} interleaved rounds, medians"]
    with tempfile.TemporaryDirectory(prefix="trillm-dp-bench-") as d:
        if not args.skip_null:
            load = {
                "concurrency": args.concurrency, "num_prompts": args.num_prompts,
                "input_len": args.input_len, "output_len": args.output_len,
            }  # fmt: skip
            flags = (
                "--executor", "null", "--null-step-time", str(args.step_time),
                "--max-num-seqs", str(args.max_num_seqs),
            )  # fmt: skip
            setups = [Setup("N=1", 1, flags), Setup("N=2", 2, flags)]
            runs = run_part(setups, load, tokenizer, args.repeats, args.seed, Path(d))
            sums = {name: summary(r) for name, r in runs.items()}
            result["null"] = {"load": load, "flags": flags, "runs": runs, "summary": sums}
            lines += ["", *table(
                f"null executor, step {args.step_time * 1e3:g} ms, --max-num-seqs "
                f"{args.max_num_seqs} per engine; c={args.concurrency}, {args.num_prompts} "
                f"requests of {args.input_len} in / {args.output_len} out",
                sums, "N=1",
            )]  # fmt: skip
        if not args.skip_model:
            load = {
                "concurrency": args.model_concurrency, "num_prompts": args.model_num_prompts,
                "input_len": args.model_input_len, "output_len": args.model_output_len,
            }  # fmt: skip
            flags = (
                "--dtype",
                "float32",
                "--device",
                "cpu",
                "--kv-cache-memory-bytes",
                "536870912",
            )
            one = {"OMP_NUM_THREADS": "1"}
            setups = [
                Setup("N=1", 1, flags),
                Setup("N=2", 2, flags),
                Setup("N=2x1t", 2, flags, one),
            ]
            torch_counts = {s.name: torch_threads(s.env) for s in setups}
            runs = run_part(setups, load, tokenizer, args.repeats, args.seed, Path(d))
            sums = {name: summary(r) for name, r in runs.items()}
            result["model"] = {
                "load": load, "flags": flags, "torch_threads_per_engine": torch_counts,
                "runs": runs, "summary": sums,
            }  # fmt: skip
            lines += ["", *table(
                f"SmolLM2-135M float32 on CPU; c={args.model_concurrency}, "
                f"{args.model_num_prompts} requests of {args.model_input_len} in / "
                f"{args.model_output_len} out; N=2x1t: OMP_NUM_THREADS=1",
                sums, "N=1",
            )]  # fmt: skip
            lines.append(
                "torch.get_num_threads() with each server's environment (fresh interpreter; "
                "the uniproc engines never set it): "
                + ", ".join(f"{k} {v}" for k, v in torch_counts.items())
            )
    if not args.skip_probe:
        result["probe"] = thread_probe(args.repeats, args.probe_seconds)
        lines += ["", *probe_table(result["probe"], args.probe_seconds)]
    lines += [
        "",
        "cores busy: all cores' busy time per second (of the machine's cores); other: that less",
        "ours (client, frontend, engines), i.e. load from outside the benchmark; client, frontend,",
        "engines, runq wait (time runnable but off a core, summed over the engines' threads):",
        "CPU seconds per second of wall time; busy threads: over 10 % of the run on a core",
    ]
    print("\n".join(lines))
    result["table"] = lines
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.txt:
        args.txt.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # `timeout` and CI stop with SIGTERM: exit through the `finally`s that stop the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
