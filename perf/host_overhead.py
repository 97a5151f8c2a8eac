"""Host cost per generated token of the real server, with the model taken out (null executor).

Starts `trillm serve --executor null --null-step-time T` (the real HTTP server, frontend,
rings, engine loop and scheduler; the "model" returns deterministic tokens after T seconds),
then streams requests at concurrency c and reports, per (T, c): streamed tokens/s, CPU
microseconds per streamed token of the frontend process (HTTP + pump + detokenise) and of the
engine process (scheduler + loop), and the achieved step period against the simulated one.
This is the (T_step, B, c) model measured: with T = 0 the host alone sets the pace.

    python perf/host_overhead.py [--step-times 0,0.005] [--concurrency 1,16,64,256,1024]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


def engine_steps(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    match = re.search(r"^trillm:engine_steps_total\{[^}]*\} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def one(client: httpx.AsyncClient, base: str, max_tokens: int) -> int:
    body = {
        "prompt": [100 + i for i in range(16)],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage"' in line and '"choices":[]' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    except httpx.TransportError:
        # Counted as failed. Seen at c = 1024: a few of 2,048 requests on reused keep-alive
        # connections closed by the server, probably hypercorn's 5 s idle timer firing while
        # the saturated server had not yet read the next request (not proven).
        return -1
    return tokens


async def load(base: str, concurrency: int, num_requests: int, max_tokens: int) -> tuple[int, int]:
    """(tokens streamed, requests failed)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:

        async def bounded() -> int:
            async with semaphore:
                return await one(client, base, max_tokens)

        results = await asyncio.gather(*(bounded() for _ in range(num_requests)))
        return sum(t for t in results if t > 0), sum(t < 0 for t in results)


def measure(
    base: str, server: int, engine: int, concurrency: int, max_tokens: int
) -> dict[str, float]:
    num = max(2 * concurrency, 32)
    asyncio.run(load(base, concurrency, num, max_tokens))  # warm-up: the same load, discarded
    steps0, front0, eng0 = engine_steps(base), cpu_seconds(server), cpu_seconds(engine)
    client0, wall0 = time.process_time(), time.perf_counter()
    tokens, failed = asyncio.run(load(base, concurrency, num, max_tokens))
    wall = time.perf_counter() - wall0
    client = time.process_time() - client0
    front, eng = cpu_seconds(server) - front0, cpu_seconds(engine) - eng0
    steps = engine_steps(base) - steps0
    return {
        "concurrency": concurrency,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "frontend_us_per_token": front / tokens * 1e6,
        "engine_us_per_token": eng / tokens * 1e6,
        "step_period_ms": wall / max(steps, 1) * 1e3,
        "client_cpu_share": client / wall,
        "failed": failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-times", default="0,0.005")
    parser.add_argument("--concurrency", default="1,16,64,256,1024")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    rows = []
    print(
        f"{'T_ms':>6}{'c':>6}{'tok/s':>10}{'front_us/tok':>14}{'engine_us/tok':>15}"
        f"{'step_ms':>9}{'client_cpu':>12}{'failed':>8}"
    )
    for step_time in map(float, args.step_times.split(",")):
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        process = subprocess.Popen(
            [
                sys.executable, "-m", "trillm.cli", "serve", "--port", str(port),
                "--executor", "null", "--null-step-time", str(step_time),
                "--max-num-seqs", "1024", "--max-num-batched-tokens", "16384",
                "--max-queued-requests", "8192",
                "--max-api-restarts", "0",  # the pid is the API server's, its child the engine
            ],
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("the server did not start")
                time.sleep(0.2)
            (engine,) = children(process.pid)
            for concurrency in map(int, args.concurrency.split(",")):
                row = {
                    "step_time_ms": step_time * 1e3,
                    **measure(base, process.pid, engine, concurrency, args.max_tokens),
                }
                rows.append(row)
                print(
                    f"{row['step_time_ms']:>6.1f}{concurrency:>6}{row['tokens_per_s']:>10.0f}"
                    f"{row['frontend_us_per_token']:>14.1f}{row['engine_us_per_token']:>15.1f}"
                    f"{row['step_period_ms']:>9.2f}{row['client_cpu_share']:>12.2f}"
                    f"{row['failed']:>8}",
                    flush=True,
                )
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
