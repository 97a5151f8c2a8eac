"""Sends the benchmark's streaming requests and times their chunks (asyncio + httpx).

One `httpx.AsyncClient` with no connection cap (the semaphore is the only limit on
concurrency, so the pool never queues a request behind our back). Chunks are parsed with
msgspec and timed with `perf_counter` as each SSE line arrives; a request that fails (HTTP
status, broken stream, an error event) becomes a `RequestOutput` with `error` set, never an
exception out of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import numpy as np
from _bench_datasets import SampleRequest
from _bench_metrics import RequestOutput

_decode = msgspec.json.Decoder().decode


@dataclass(frozen=True)
class ClientConfig:
    """What every request shares: the endpoint, the model and the vLLM-only fields' switch."""

    base_url: str
    model: str
    endpoint: str  # "completions" or "chat"
    ignore_eos: bool = False
    api_key: str | None = None
    timeout_s: float = 600.0

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path


def request_body(config: ClientConfig, sample: SampleRequest) -> dict[str, Any]:
    """The JSON body: greedy-free defaults, `max_tokens` = the output length, usage on."""
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": sample.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        prompt = sample.prompt if isinstance(sample.prompt, str) else str(sample.prompt)
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = sample.prompt
    if config.ignore_eos:  # vLLM extensions: a stock OpenAI server rejects unknown fields
        body |= {"ignore_eos": True, "min_tokens": sample.output_len}
    return body


def chunk_text(chunk: dict[str, Any], endpoint: str) -> str:
    """The content a chunk carries (a chat role-only first chunk carries none)."""
    text = ""
    for choice in chunk.get("choices") or ():
        if endpoint == "chat":
            text += (choice.get("delta") or {}).get("content") or ""
        else:
            text += choice.get("text") or ""
    return text


async def send_request(
    client: httpx.AsyncClient,
    config: ClientConfig,
    sample: SampleRequest,
    count_tokens: Callable[[str], int] | None,
    t0: float,
) -> RequestOutput:
    """Stream one request and time it; every failure is recorded in `error`."""
    out = RequestOutput(prompt_len=sample.prompt_len, expected_output_len=sample.output_len)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    start = time.perf_counter()
    out.start_time = start - t0
    last = start
    try:
        body = request_body(config, sample)
        async with client.stream("POST", config.url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                out.error = f"HTTP {resp.status_code}: {detail}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = _decode(data)
                if "error" in chunk:
                    out.error = f"stream error: {chunk['error']}"
                    return out
                usage = chunk.get("usage") or usage
                text = chunk_text(chunk, config.endpoint)
                if text:
                    if not pieces:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    pieces.append(text)
        out.latency = time.perf_counter() - start
    except (httpx.HTTPError, msgspec.DecodeError, OSError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.generated_text = "".join(pieces)
    if not pieces:
        out.ttft = out.latency  # nothing visible streamed: the first "token" is the end
    if usage and usage.get("completion_tokens") is not None:
        out.output_tokens = int(usage["completion_tokens"])
        out.prompt_len = int(usage.get("prompt_tokens") or out.prompt_len)
    elif count_tokens is not None:
        out.output_tokens = count_tokens(out.generated_text)
    else:
        out.output_tokens = len(pieces)  # no usage, no tokenizer: one token per chunk
    return out


def arrival_delays(num: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Seconds between request starts: gamma(shape=burstiness) with mean 1/rate; 0 for inf.

    Shape 1 is a Poisson process; below 1 arrivals bunch up, above 1 they even out.
    """
    if rate == float("inf"):
        return np.zeros(num)
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"--request-rate and --burstiness must be > 0, not {rate}, {burstiness}")
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)


async def _progress(done: list[RequestOutput], total: int, t0: float) -> None:
    """A one-line progress report on stderr every half second until cancelled."""
    while True:
        elapsed = time.perf_counter() - t0
        failed = sum(not o.success for o in done)
        sys.stderr.write(f"\r  {len(done)}/{total} done, {failed} failed, {elapsed:6.1f} s")
        sys.stderr.flush()
        await asyncio.sleep(0.5)


@contextlib.asynccontextmanager
async def open_client(config: ClientConfig) -> AsyncIterator[httpx.AsyncClient]:
    """The shared client: no pool cap, the benchmark's timeout, keep-alive connections."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        yield client


async def run_requests(
    client: httpx.AsyncClient,
    config: ClientConfig,
    samples: list[SampleRequest],
    delays: np.ndarray,
    max_concurrency: int | None,
    count_tokens: Callable[[str], int] | None,
    *,
    show_progress: bool = True,
) -> tuple[list[RequestOutput], float]:
    """Start each request after its delay (at most `max_concurrency` in flight).

    Returns:
        The outputs in prompt order and the wall time from the first start to the last end.
    """
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    done: list[RequestOutput] = []
    t0 = time.perf_counter()

    async def one(sample: SampleRequest) -> RequestOutput:
        async with semaphore or contextlib.nullcontext():
            out = await send_request(client, config, sample, count_tokens, t0)
        done.append(out)
        return out

    progress = asyncio.create_task(_progress(done, len(samples), t0)) if show_progress else None
    tasks = []
    for i, (sample, delay) in enumerate(zip(samples, delays, strict=True)):
        if i > 0 and delay > 0:  # the first request starts at once; delays are gaps
            await asyncio.sleep(float(delay))
        tasks.append(asyncio.create_task(one(sample)))
    outputs = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - t0
    if progress is not None:
        progress.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await progress
        sys.stderr.write(f"\r  {len(done)}/{len(samples)} done in {duration:.1f} s\n")
    return outputs, duration
