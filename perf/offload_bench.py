"""What the HTTP edge's thread offload costs against the work it moves (`http/edge/_offload.py`).

    .venv/bin/python perf/offload_bench.py

Prints medians, in one process: a round trip to a worker thread (`trio.to_thread.run_sync`
with a `CapacityLimiter`, the offload's own call) of a function that does nothing, beside
tokenising texts of growing length and rendering small chat templates with the built-in
model's tokenizer. The ratio column is the work's time over the hop's: below 1 the hop costs
more than running the work on the loop. `INLINE_BELOW` (512 characters) sits where tokenising
costs a few hops: small enough that the loop never runs one input for long.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import trio

from trillm.default_model import default_model_dir
from trillm.engine.client.inputs._tokenizer import load_tokenizer
from trillm.http.edge._offload import INLINE_BELOW, Offload

ROUNDS = 300


def median_us(fn: Callable[[], object], rounds: int = ROUNDS) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


async def hop_us() -> float:
    offload = Offload(2)
    times = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        await offload.run(INLINE_BELOW, lambda: None)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    tokenizer = load_tokenizer(str(default_model_dir()))
    hop = trio.run(hop_us)
    print(f"{'work':<36} {'median us':>10} {'/ hop':>7}")
    print(f"{'thread hop (nothing)':<36} {hop:>10.1f} {1.0:>7.2f}")
    sentence = "The quick brown fox jumps over the lazy dog, again and again. "
    for size in (16, 64, 256, INLINE_BELOW, 2048, 8192):
        text = (sentence * (size // len(sentence) + 1))[:size]
        us = median_us(lambda text=text: tokenizer(text)["input_ids"])  # type: ignore[misc]
        print(f"{f'tokenise {size} characters':<36} {us:>10.1f} {us / hop:>7.2f}")
    for count in (2, 8, 64):
        messages = [{"role": "user", "content": "hello there"}] * count
        us = median_us(
            lambda messages=messages: tokenizer.apply_chat_template(  # type: ignore[misc]
                messages, tokenize=False, add_generation_prompt=True
            ),
            rounds=50,
        )
        print(f"{f'chat template, {count} messages':<36} {us:>10.1f} {us / hop:>7.2f}")


if __name__ == "__main__":
    main()
