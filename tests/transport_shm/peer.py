"""Peer processes for the transport tests: ``python peer.py ROLE ARGS...``.

Each role attaches to rings whose address (and inherited doorbell fds) it is given, does one
thing, and reports on stdout as one JSON line, so the tests exercise real processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import trio

from trillm.transport_shm import RingAddress, RingReader, RingWriter

HERE = os.path.abspath(__file__)


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def echo(addr_in: str, addr_out: str) -> None:
    """Copy every record of ring IN to ring OUT until IN's writer closes."""
    with (
        RingReader.attach(RingAddress.decode(addr_in)) as reader,
        RingWriter.attach(RingAddress.decode(addr_out)) as writer,
    ):
        while True:
            try:
                kind, payload = reader.peek(timeout=60)
            except trio.BrokenResourceError:
                return
            writer.reserve(len(payload), timeout=60)[:] = payload
            writer.commit(kind)
            reader.release()


def broadcast_reader(addr: str, index: str, slow: str) -> None:
    """Read sequence-numbered records; report how many, and a digest of their bytes."""
    digest = hashlib.sha256()
    expected = 0
    with RingReader.attach(RingAddress.decode(addr), int(index)) as reader:
        while True:
            try:
                kind, payload = reader.peek(timeout=60)
            except trio.BrokenResourceError:
                break
            seq = int.from_bytes(payload[:8], "little")
            if seq != expected or kind != seq % 1000:
                say(error=f"reader {index}: expected record {expected}, got {seq} kind {kind}")
                return
            digest.update(payload)
            expected += 1
            reader.release()
            if slow == "1" and expected % 50 == 0:
                time.sleep(0.002)
    say(index=int(index), count=expected, digest=digest.hexdigest())


def burst_writer(addr: str, num_records: str, seed: str) -> None:
    """Write records stamped with a sequence number and `perf_counter_ns`, in bursts and pauses."""
    rng = random.Random(int(seed))
    total = int(num_records)
    with RingWriter.attach(RingAddress.decode(addr)) as writer:
        time.sleep(0.2)  # the reader is asleep on an empty ring by now
        seq = 0
        while seq < total:
            for _ in range(min(rng.randint(1, 40), total - seq)):
                view = writer.reserve(16 + rng.randint(0, 200), timeout=60)
                view[:8] = seq.to_bytes(8, "little")
                view[8:16] = time.perf_counter_ns().to_bytes(8, "little")
                writer.commit(1)
                seq += 1
            pause = rng.choice([0.0, 0.0, 0.00005, 0.0005, 0.002])
            if pause:
                time.sleep(pause)
        say(sent=seq)


def hold(role: str, addr: str) -> None:
    """Attach as `role` (writer|reader), report, then wait to be killed."""
    address = RingAddress.decode(addr)
    end = RingWriter.attach(address) if role == "writer" else RingReader.attach(address)
    say(attached=os.getpid())
    with end:
        signal.pause()


def pair(role: str, handshake: str) -> None:
    """Create a ring as `role`, spawn its peer as a child, report both pids, wait to be killed.

    With ``handshake=0`` the peer is never started, so the name stays until a sweep.
    """
    end = RingWriter.create(4096) if role == "writer" else RingReader.create(4096)
    if handshake == "0":
        say(creator=os.getpid(), name=end.address.name)
        signal.pause()
    peer_role = "reader" if role == "writer" else "writer"
    child = subprocess.Popen(
        [sys.executable, HERE, "hold", peer_role, end.address.encode()],
        pass_fds=end.address.fds,
        stdout=subprocess.PIPE,
    )
    assert child.stdout is not None
    child.stdout.readline()
    end.wait_attached(timeout=30)
    say(creator=os.getpid(), peer=child.pid, name=end.address.name)
    with end:
        signal.pause()


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    {
        "echo": echo,
        "broadcast-reader": broadcast_reader,
        "burst-writer": burst_writer,
        "hold": hold,
        "pair": pair,
    }[role](*args)
