"""Frontend host cost per streamed token: the real output pump, mailboxes and consumers.

A producer process writes synthetic STEP records (B rows, one token each, token ids of real
English text under the default tokenizer) into a real ring as fast as the ring takes them.
This process runs trio: one pump task reads each record and runs the real `OutputProcessor`
(incremental detokenisation, stop-string checks with hold-back, mailboxes, batched wake-ups),
and B consumer tasks each take their outputs and encode an OpenAI SSE chunk (bytes, no
socket). Reported: this process's CPU time per streamed token, over N steps after a warm-up.

    python perf/frontend_bench.py [--batches 1,64,256,1024] [--steps N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import trio

from trillm.engine.client.outputs._detokenizer import IncrementalDetokenizer, StopChecker
from trillm.engine.client.outputs._output_processor import OutputProcessor, RequestState
from trillm.engine.client.outputs._outputs import Mailbox
from trillm.engine.protocol._step_record import StepView, write_step
from trillm.transport_shm import RingAddress, RingReader, RingWriter

TEXT = (Path(__file__).resolve().parents[1] / "README.md").read_text() * 4


class Delta(msgspec.Struct):
    content: str


class Choice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None


class Chunk(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[Choice]


def produce(address: str, batch: int, steps: int, tokens_path: str) -> None:
    """The child: `steps` STEP records of `batch` rows, then one that finishes every row."""
    tokens = np.load(tokens_path)
    with RingWriter.attach(RingAddress.decode(address)) as writer:
        rnums = np.arange(1, batch + 1, dtype=np.uint64)
        offsets = np.arange(batch + 1, dtype=np.uint32)
        running = np.zeros(batch, np.uint8)
        for step in range(steps + 1):
            row_tokens = tokens[(np.arange(batch) * 13 + step) % len(tokens)]
            finish = running if step < steps else np.full(batch, 2, np.uint8)
            write_step(writer, step, rnums, offsets, row_tokens.astype(np.int32), finish)


async def consume(
    mailbox: Mailbox, rnum: int, encoder: msgspec.json.Encoder, sink: list[int]
) -> None:
    total = 0
    while True:
        outputs = await mailbox.get()
        for output in outputs:
            chunk = Chunk(
                f"cmpl-{rnum}",
                "text_completion",
                1700000000,
                "SmolLM2-135M-Instruct",
                [Choice(output.index, Delta(output.text), output.finish_reason)],
            )
            total += len(b"data: " + encoder.encode(chunk) + b"\n\n")
            if output.finished:
                sink.append(total)
                return


async def run_frontend(
    reader: RingReader, batch: int, steps: int, warmup: int, tokenizer: object
) -> float:
    processor = OutputProcessor()
    encoder = msgspec.json.Encoder()
    sink: list[int] = []
    cpu_at_warmup = 0.0
    async with trio.open_nursery() as nursery:
        for rnum in range(1, batch + 1):
            mailbox = Mailbox()
            processor.add(
                RequestState(
                    rnum=rnum,
                    index=0,
                    mailbox=mailbox,
                    detokenizer=IncrementalDetokenizer(tokenizer, [1, 2, 3]),  # type: ignore[arg-type]
                    stop=StopChecker(["\nUser:"]),
                    num_prompt_tokens=3,
                    logprobs=None,
                )
            )
            nursery.start_soon(consume, mailbox, rnum, encoder, sink)
        for step in range(steps + 1):
            if step == warmup:
                cpu_at_warmup = time.process_time()
            _, payload = await reader.peek_async()
            processor.process_step(StepView(payload))
            reader.release()
    cpu = time.process_time() - cpu_at_warmup
    assert len(sink) == batch
    return cpu / ((steps + 1 - warmup) * batch) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,64,256,1024")
    parser.add_argument("--steps", type=int, help="steps per batch (default: ~100k tokens)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--produce", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.produce:
        address, batch, steps, path = args.produce
        produce(address, int(batch), int(steps), path)
        return
    from tokenizers import Tokenizer

    from trillm.default_model import default_model_dir

    model = default_model_dir(progress=False)
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokens = np.array(tokenizer.encode(TEXT).ids, np.int32)
    tokens_path = "/tmp/trillm-frontend-bench-tokens.npy"
    np.save(tokens_path, tokens)
    rows = []
    print(f"{'B':>6}{'us/token':>10}   (median of {args.repeats}, frontend process CPU)")
    for batch in map(int, args.batches.split(",")):
        steps = args.steps or max(50, 100_000 // batch)
        warmup = max(5, steps // 10)
        runs = []
        for _ in range(args.repeats):
            with RingReader.create(1 << 24) as reader:
                child = subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--produce",
                        reader.address.encode(),
                        str(batch),
                        str(steps),
                        tokens_path,
                    ],
                    pass_fds=reader.address.fds,
                )
                reader.wait_attached(timeout=60)
                runs.append(trio.run(run_frontend, reader, batch, steps, warmup, tokenizer))
                child.wait(timeout=60)
        row = {"batch": batch, "us_per_token": round(statistics.median(runs), 2)}
        rows.append(row)
        print(f"{batch:>6}{row['us_per_token']:>10.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
