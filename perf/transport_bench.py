"""Per-step host cost of engine -> frontend outputs: trillm's ring against vLLM V1's design.

Two processes. The engine side (a child) turns one step's sampled tokens for B requests into
a message and sends it; the frontend side (this process) receives it, decodes it and fans it
out to per-request token lists. Transports, in the same run:

- ``shm_columnar``: a trillm `RingWriter`/`RingReader`; one columnar record per step
  (header, rnum u64[B], tok_offsets u32[B+1], tokens i32[B], finish u8[B]), written in
  place and read through numpy views (DESIGN.md §4).
- ``zmq_msgspec``: the vLLM V1 baseline: `EngineCoreOutputs` of B `EngineCoreOutput` structs
  with 34-character request ids, msgpack-encoded by msgspec, over pyzmq ``ipc://`` PUSH/PULL,
  decoded and fanned out by id.

Each round the engine writes K steps back to back (timing each build+encode+send) and then
the frontend processes the K queued steps (timing each receive+decode+fan-out), so neither side
waits inside a timed section and the two never compete for the 2 cores. Medians over rounds.
Also measured: the wake-up latency of an idle trio reader (write -> `peek_async` returns),
and the doorbell counters of a free-running stream.

    python perf/transport_bench.py [--json PATH] [--batches 1,8,...] [--rounds R --steps K]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import trio
import zmq

from trillm.transport_shm import RingAddress, RingReader, RingWriter

BATCHES = (1, 8, 64, 128, 256, 1024)
KIND_STEP = 1
FIRST_RNUM = 1000
STEP_HEADER = struct.Struct("<QIIIIQ")  # step, rows, tokens, sections, num_finished, ns


# -- the vLLM V1 baseline's messages (vllm/v1/engine/__init__.py, fields in its order) ------


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[list[float]] | None = None
    new_prompt_logprobs_tensors: bytes | None = None
    pooling_output: bytes | None = None
    finish_reason: int | None = None
    stop_reason: int | str | None = None
    events: list[tuple[int, float]] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    trace_headers: dict[str, str] | None = None
    num_cached_tokens: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: dict[str, Any] | None = None
    timestamp: float = 0.0
    utility_output: bytes | None = None
    finished_requests: list[str] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None


def request_ids(batch: int) -> list[str]:
    """vLLM-style 34-character ids: ``chatcmpl-<16 hex>-<8 hex>``."""
    return [f"chatcmpl-{secrets.token_hex(8)}-{secrets.token_hex(4)}" for _ in range(batch)]


def align8(n: int) -> int:
    return (n + 7) & ~7


def columnar_offsets(rows: int, tokens: int) -> tuple[int, int, int, int, int]:
    """Byte offsets of rnum, tok_offsets, tokens, finish, and the record size."""
    rnum = STEP_HEADER.size
    offsets = rnum + 8 * rows
    toks = align8(offsets + 4 * (rows + 1))
    finish = align8(toks + 4 * tokens)
    return rnum, offsets, toks, finish, finish + rows


# -- engine side (child process) -----------------------------------------------------------


class ShmEngine:
    """Writes one columnar STEP record per step into the ring, in place."""

    def __init__(self, address: RingAddress) -> None:
        self.writer = RingWriter.attach(address)

    def prepare(self, batch: int, ids: list[str] | None = None) -> None:
        self.rnums = np.arange(
            FIRST_RNUM, FIRST_RNUM + batch, dtype=np.uint64
        )  # the scheduler's batch
        self.offsets = np.arange(batch + 1, dtype=np.uint32)  # one token per row
        self.finish = np.zeros(batch, dtype=np.uint8)
        self.layout = columnar_offsets(batch, batch)

    def send(self, step: int, sampled: np.ndarray) -> int:
        rows = len(self.rnums)
        o_rnum, o_offsets, o_tokens, o_finish, size = self.layout
        view = self.writer.reserve(size)
        STEP_HEADER.pack_into(view, 0, step, rows, rows, 0, 0, time.monotonic_ns())
        view[o_rnum:o_offsets] = memoryview(self.rnums).cast("B")
        view[o_offsets : o_offsets + 4 * (rows + 1)] = memoryview(self.offsets).cast("B")
        view[o_tokens : o_tokens + 4 * rows] = memoryview(sampled).cast("B")
        view[o_finish:size] = memoryview(self.finish).cast("B")
        self.writer.commit(KIND_STEP)
        return (size + 15) & ~7

    def close(self) -> None:
        self.writer.close()


class ZmqEngine:
    """Builds B `EngineCoreOutput`s per step, encodes them, sends them (as vLLM V1 does)."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.connect(endpoint)
        self.encoder = msgspec.msgpack.Encoder()

    def prepare(self, batch: int, ids: list[str] | None = None) -> None:
        self.ids = ids or request_ids(batch)

    def send(self, step: int, sampled: np.ndarray) -> int:
        outputs = [
            EngineCoreOutput(
                request_id=request_id,
                new_token_ids=[token],
                finish_reason=None,
                stop_reason=None,
                num_cached_tokens=0,
            )
            for request_id, token in zip(self.ids, sampled.tolist(), strict=True)
        ]
        message = EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic())
        frame = self.encoder.encode(message)
        self.sock.send(frame, copy=False)
        return len(frame)

    def close(self) -> None:
        self.sock.close(linger=1000)
        self.ctx.term()


def engine_main(address: str, endpoint: str, floor_fd: str) -> None:
    """The child: obey one JSON command per stdin line, answer one JSON line on stdout."""
    engines: dict[str, ShmEngine | ZmqEngine] = {
        "shm_columnar": ShmEngine(RingAddress.decode(address)),
        "zmq_msgspec": ZmqEngine(endpoint),
    }
    rng = np.random.default_rng(0)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "cpu":  # this process's CPU time, all threads (zmq's I/O thread too)
            reply: dict[str, Any] = {"cpu_ns": time.process_time_ns()}
        elif cmd["op"] == "wake":  # every `gap` s: a ring record, then a bare eventfd write
            ring = engines["shm_columnar"]
            assert isinstance(ring, ShmEngine)
            rings_before = ring.writer.statistics().doorbell_rings
            for _ in range(cmd["count"]):
                time.sleep(cmd["gap"])
                reserved = time.perf_counter_ns()
                view = ring.writer.reserve(16)
                view[:8] = reserved.to_bytes(8, "little")
                view[8:] = time.perf_counter_ns().to_bytes(8, "little")  # then it is published
                ring.writer.commit(2)
                time.sleep(cmd["gap"])
                os.eventfd_write(int(floor_fd), time.perf_counter_ns())
            reply = {"rings": ring.writer.statistics().doorbell_rings - rings_before}
        elif cmd["op"] == "stream":  # free-running, back-to-back steps
            engine = engines["shm_columnar"]
            engine.prepare(cmd["batch"])
            before = engine.writer.statistics()  # type: ignore[union-attr]
            sampled = rng.integers(0, 49152, cmd["batch"], dtype=np.int32)
            for step in range(cmd["steps"]):
                engine.send(step, sampled)
            after = engine.writer.statistics()  # type: ignore[union-attr]
            reply = {
                "rings": after.doorbell_rings - before.doorbell_rings,
                "sleeps": after.sleeps - before.sleeps,
            }
        else:  # "steps": K timed steps of one transport
            engine = engines[cmd["transport"]]
            engine.prepare(cmd["batch"], cmd.get("ids"))
            times, nbytes = [], 0
            pool = [rng.integers(0, 49152, cmd["batch"], dtype=np.int32) for _ in range(16)]
            for step in range(cmd["steps"]):
                sampled = pool[step % 16]  # the sampler's output, already on the host
                start = time.perf_counter_ns()
                nbytes = engine.send(step, sampled)
                times.append(time.perf_counter_ns() - start)
            reply = {"ns": times, "bytes": nbytes}
        print(json.dumps(reply), flush=True)
    for engine in engines.values():
        engine.close()


# -- frontend side (this process) ----------------------------------------------------------


def shm_receiver(reader: RingReader) -> Callable[[dict[int, list[int]]], None]:
    """Receive one STEP record, read it through numpy views, fan tokens out per rnum."""

    def receive(states: dict[int, list[int]]) -> None:
        _, payload = reader.peek()
        _, rows, tokens, _, num_finished, _ = STEP_HEADER.unpack_from(payload)
        o_rnum, o_offsets, o_tokens, o_finish, _ = columnar_offsets(rows, tokens)
        rnums = payload[o_rnum:o_offsets].cast("Q").tolist()  # views of the ring, no copy
        token_ids = payload[o_tokens : o_tokens + 4 * tokens].cast("i").tolist()
        if rows == tokens:  # one token per row: the decode fast path
            for rnum, token in zip(rnums, token_ids, strict=True):
                states[rnum].append(token)
        else:
            offsets = payload[o_offsets : o_offsets + 4 * (rows + 1)].cast("I").tolist()
            for i, rnum in enumerate(rnums):
                states[rnum].extend(token_ids[offsets[i] : offsets[i + 1]])
        if num_finished:  # pragma: no cover - the bench never finishes a request
            finish = np.frombuffer(payload, np.uint8, rows, o_finish)
            raise AssertionError(f"unexpected finish codes {np.flatnonzero(finish)}")
        reader.release()

    return receive


def zmq_receiver(sock: zmq.Socket[Any]) -> Callable[[dict[str, list[int]]], None]:
    """Receive one message, decode B structs, fan tokens out per request id (vLLM V1)."""
    decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)

    def receive(states: dict[str, list[int]]) -> None:
        frame = sock.recv(copy=False)
        outputs = decoder.decode(frame.buffer)
        for output in outputs.outputs:
            states[output.request_id].extend(output.new_token_ids)

    return receive


class Bench:
    """The frontend side: owns the child engine process, the ring and the zmq socket."""

    def __init__(self) -> None:
        self.reader = RingReader.create(8 << 20)
        self.endpoint = f"ipc:///tmp/trillm-bench-{os.getpid()}.ipc"
        self.floor_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(self.endpoint)
        self.child = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--engine",
                self.reader.address.encode(),
                self.endpoint,
                str(self.floor_fd),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(*self.reader.address.fds, self.floor_fd),
            text=True,
        )
        self.reader.wait_attached(timeout=60)

    def command(self, **cmd: Any) -> None:
        assert self.child.stdin is not None
        self.child.stdin.write(json.dumps(cmd) + "\n")
        self.child.stdin.flush()

    def reply(self) -> dict[str, Any]:
        assert self.child.stdout is not None
        line = self.child.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine process died (exit {self.child.wait()})")
        result: dict[str, Any] = json.loads(line)
        return result

    def child_cpu_ns(self) -> int:
        self.command(op="cpu")
        cpu_ns: int = self.reply()["cpu_ns"]
        return cpu_ns

    def round(self, transport: str, batch: int, steps: int, ids: list[str]) -> dict[str, Any]:
        """K steps: the engine writes them all, then we read them all."""
        states: dict[Any, list[int]]
        receive: Callable[[Any], None]
        child_start = self.child_cpu_ns()
        start_cpu = time.process_time_ns()
        if transport == "shm_columnar":
            states = {FIRST_RNUM + i: [] for i in range(batch)}
            receive = shm_receiver(self.reader)
            self.command(op="steps", transport=transport, batch=batch, steps=steps)
        else:
            states = {request_id: [] for request_id in ids}
            receive = zmq_receiver(self.pull)
            self.command(op="steps", transport=transport, batch=batch, steps=steps, ids=ids)
        reply = self.reply()  # all K steps are queued now
        times = []
        for _ in range(steps):
            start = time.perf_counter_ns()
            receive(states)
            times.append(time.perf_counter_ns() - start)
        frontend_cpu = time.process_time_ns() - start_cpu
        engine_cpu = self.child_cpu_ns() - child_start
        if any(len(tokens) != steps for tokens in states.values()):
            raise AssertionError(f"{transport} lost or duplicated tokens")
        return {
            "engine_ns": reply["ns"],
            "frontend_ns": times,
            "bytes": reply["bytes"],
            "engine_cpu": engine_cpu,
            "frontend_cpu": frontend_cpu,
        }

    def measure(self, transport: str, batch: int, rounds: int, steps: int) -> dict[str, Any]:
        """Medians of `rounds` rounds of K steps (after one warm-up round).

        ``engine_us``/``frontend_us``: median of the timed sections. ``*_cpu_us``: process
        CPU time (every thread, so zmq's I/O threads count) per step, less what an empty
        round costs, median over rounds.
        """
        ids = request_ids(batch)
        self.round(transport, batch, steps, ids)  # warm-up
        empty = [self.round(transport, batch, 0, ids) for _ in range(3)]
        idle_engine = statistics.median(r["engine_cpu"] for r in empty)
        idle_frontend = statistics.median(r["frontend_cpu"] for r in empty)
        done = [self.round(transport, batch, steps, ids) for _ in range(rounds)]
        engine_us = statistics.median(t for r in done for t in r["engine_ns"]) / 1e3
        frontend_us = statistics.median(t for r in done for t in r["frontend_ns"]) / 1e3
        engine_cpu = statistics.median(r["engine_cpu"] - idle_engine for r in done) / steps
        frontend_cpu = statistics.median(r["frontend_cpu"] - idle_frontend for r in done) / steps
        return {
            "transport": transport,
            "batch": batch,
            "engine_us": round(engine_us, 2),
            "frontend_us": round(frontend_us, 2),
            "ns_per_token": round((engine_us + frontend_us) * 1e3 / batch, 1),
            "bytes_per_step": done[-1]["bytes"],
            "engine_cpu_us": round(engine_cpu / 1e3, 2),
            "frontend_cpu_us": round(frontend_cpu / 1e3, 2),
            "cpu_ns_per_token": round((engine_cpu + frontend_cpu) / batch, 1),
        }

    async def wake_latency(self, count: int, gap: float) -> dict[str, Any]:
        """An idle trio reader: median microseconds from a write to `peek_async` returning.

        Measured from the writer's `commit` (the record's publication: the write) and, more
        conservatively, from before its `reserve`. Interleaved with the same wake-up through
        a bare eventfd and `trio.lowlevel.wait_readable`: the floor that trio and this machine
        set, measured from just before the eventfd write.
        """
        before = self.reader.statistics()
        self.command(op="wake", count=count, gap=gap)
        latencies, from_reserve, floor = [], [], []
        for _ in range(count):  # interleaved, so both see the same machine
            _, payload = await self.reader.peek_async()
            woke = time.perf_counter_ns()
            reserved, committed = struct.unpack_from("<QQ", payload)
            latencies.append((woke - committed) / 1e3)
            from_reserve.append((woke - reserved) / 1e3)
            self.reader.release()
            await trio.lowlevel.wait_readable(self.floor_fd)
            woke = time.perf_counter_ns()
            floor.append((woke - os.eventfd_read(self.floor_fd)) / 1e3)
        reply = self.reply()
        return {
            "median_us": round(statistics.median(latencies), 1),
            "median_from_reserve_us": round(statistics.median(from_reserve), 1),
            "floor_median_us": round(statistics.median(floor), 1),
            "p90_us": round(float(np.percentile(latencies, 90)), 1),
            "records": count,
            "reader_sleeps": self.reader.statistics().sleeps - before.sleeps,
            "writer_doorbell_rings": reply["rings"],
        }

    async def hot_stream(self, batch: int, steps: int) -> dict[str, Any]:
        """A free-running engine and a trio pump: how often anyone had to ring a doorbell."""
        before = self.reader.statistics()
        self.command(op="stream", batch=batch, steps=steps)
        states: dict[int, list[int]] = {FIRST_RNUM + i: [] for i in range(batch)}
        receive = shm_receiver(self.reader)
        start = time.perf_counter()
        for _ in range(steps):
            await self.reader.peek_async()
            receive(states)
        elapsed = time.perf_counter() - start
        reply = self.reply()
        after = self.reader.statistics()
        return {
            "batch": batch,
            "records": steps,
            "steps_per_s": round(steps / elapsed),
            "writer_doorbell_rings": reply["rings"],
            "writer_sleeps": reply["sleeps"],
            "reader_doorbell_rings": after.doorbell_rings - before.doorbell_rings,
            "reader_sleeps": after.sleeps - before.sleeps,
        }

    def close(self) -> None:
        self.command(op="quit")
        self.child.wait(timeout=30)
        self.reader.close()
        self.pull.close(linger=0)
        self.ctx.term()
        os.close(self.floor_fd)
        if os.path.exists(self.endpoint[len("ipc://") :]):
            os.unlink(self.endpoint[len("ipc://") :])


def print_table(results: list[dict[str, Any]], wake: dict[str, Any], hot: dict[str, Any]) -> None:
    print(
        f"{'transport':<14}{'B':>6}{'engine_us':>11}{'frontend_us':>13}{'ns/token':>10}"
        f"{'bytes/step':>12} | {'engine_cpu':>10}{'frontend_cpu':>13}{'cpu_ns/tok':>11}"
    )
    for r in results:
        print(
            f"{r['transport']:<14}{r['batch']:>6}{r['engine_us']:>11.2f}{r['frontend_us']:>13.2f}"
            f"{r['ns_per_token']:>10.1f}{r['bytes_per_step']:>12} | {r['engine_cpu_us']:>10.2f}"
            f"{r['frontend_cpu_us']:>13.2f}{r['cpu_ns_per_token']:>11.1f}"
        )
    print("\nshm_columnar / zmq_msgspec (lower is better):")
    print(f"{'B':>6}{'engine':>10}{'frontend':>10}{'per token':>11} | {'cpu/token':>10}")
    by_key = {(r["transport"], r["batch"]): r for r in results}
    for batch in sorted({r["batch"] for r in results}):
        shm, zmq_ = by_key[("shm_columnar", batch)], by_key[("zmq_msgspec", batch)]
        print(
            f"{batch:>6}{shm['engine_us'] / zmq_['engine_us']:>10.3f}"
            f"{shm['frontend_us'] / zmq_['frontend_us']:>10.3f}"
            f"{shm['ns_per_token'] / zmq_['ns_per_token']:>11.3f} | "
            f"{shm['cpu_ns_per_token'] / zmq_['cpu_ns_per_token']:>10.3f}"
        )
    print(
        f"\nidle trio reader wake-up from commit: median {wake['median_us']} us, "
        f"p90 {wake['p90_us']} us (from reserve: median {wake['median_from_reserve_us']} us; "
        f"{wake['records']} records, {wake['writer_doorbell_rings']} doorbell rings); "
        f"bare trio.lowlevel.wait_readable on an eventfd: median {wake['floor_median_us']} us"
    )
    print(
        f"free-running stream, B={hot['batch']}: {hot['records']} records at "
        f"{hot['steps_per_s']} steps/s; doorbell rings: writer {hot['writer_doorbell_rings']}, "
        f"reader {hot['reader_doorbell_rings']}; sleeps: writer {hot['writer_sleeps']}, "
        f"reader {hot['reader_sleeps']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--rounds", type=int, default=20, help="rounds per (transport, B)")
    parser.add_argument("--steps", type=int, default=50, help="steps per round (K)")
    parser.add_argument("--wake-count", type=int, default=500)
    parser.add_argument("--engine", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine_main(*args.engine)
        return
    bench = Bench()
    try:
        results = [
            bench.measure(transport, batch, args.rounds, args.steps)
            for batch in map(int, args.batches.split(","))
            for transport in ("shm_columnar", "zmq_msgspec")
        ]
        wake = trio.run(bench.wake_latency, args.wake_count, 0.002)
        hot = trio.run(bench.hot_stream, 256, 5000)
    finally:
        bench.close()
    print_table(results, wake, hot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "results": results,
                    "trio_wake_us_idle": wake["median_us"],
                    "trio_wake": wake,
                    "hot_stream": hot,
                    "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
                },
                f,
                indent=2,
            )
            f.write("\n")


if __name__ == "__main__":
    main()
