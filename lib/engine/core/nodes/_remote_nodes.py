"""The executor's side of tensor parallelism across nodes: one TCP connection per node agent.

Node 0's executor listens on ``master_addr:master_port + 1`` (torch.distributed's store has
``master_port``). Each node agent (`_node_agent`) connects, proves the node token and says who
it is (`_node_link`'s handshake, accepted by `_node_join`), then receives every broadcast
record and writes it into its own node's broadcast ring. The agent sends back its ranks'
replies (LOAD's block counts, INIT_KV's OK, FAILURE records), their exits, and an ALIVE frame
at most every `WATCH_INTERVAL` while every rank it has not reported is alive. Frames both ways::

    [u32 payload length][u32 kind][i32 global rank, -1: the node][u32 0][i64 sender's
    CLOCK_MONOTONIC ns][payload]

Clocks: the sender's time is moved onto ours by the smallest ``received - sent`` seen (the
true offset plus the shortest one-way latency), so a remote FAILURE record and a remote
rank's "alive at" compete with local ranks' times for the root cause as local ones do. A
lost connection dates the death of every rank of that node to its last ALIVE frame.
"""

from __future__ import annotations

import collections
import contextlib
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Final

import trio

from ....gpu import worker_process as W
from ....transport_shm import BusyError, Record
from ...protocol._errors import RemoteError
from ..executor._ranks import RankState
from ._node_link import FRAME as FRAME

NODE_ALIVE: Final = 202  # agent -> executor: its unreported ranks were alive at the frame's time
NODE_RANK_EXIT: Final = 203  # agent -> executor, a rank's: i64 returncode, i64 alive at (ns)
RANK_EXIT: Final = struct.Struct("<qq")
LISTEN_PORT_OFFSET: Final = 1  # the listener is on master_port + 1
WATCH_INTERVAL: Final = 0.02


def encode_frame(kind: int, payload: bytes | bytearray | memoryview = b"", rank: int = -1) -> bytes:
    return FRAME.pack(len(payload), kind, rank, 0, time.monotonic_ns()) + bytes(payload)


class FrameBuffer:
    """Bytes received so far, cut into whole frames."""

    def __init__(self) -> None:
        self.data = bytearray()

    def next_frame(self) -> tuple[int, int, int, bytes] | None:
        """The first complete frame received, taken out: (kind, rank, sent ns, payload)."""
        if len(self.data) < FRAME.size:
            return None
        length, kind, rank, _, sent_ns = FRAME.unpack_from(self.data)
        end = FRAME.size + length
        if len(self.data) < end:
            return None
        payload = bytes(self.data[FRAME.size : end])
        del self.data[:end]
        return kind, rank, sent_ns, payload

    def frames(self) -> list[tuple[int, int, int, bytes]]:
        """Every complete frame received, taken out."""
        out = []
        while (frame := self.next_frame()) is not None:
            out.append(frame)
        return out


class RemoteResults:
    """A remote rank's replies, in arrival order, read like a result ring."""

    def __init__(self, node: RemoteNode) -> None:
        self.node = node
        self.queue: collections.deque[Record] = collections.deque()

    def try_peek(self) -> Record | None:
        if self.queue:
            return self.queue[0]
        if self.node.is_closed:
            raise trio.BrokenResourceError(f"node {self.node.node_rank} is gone")
        return None

    def peek(self, timeout: float | None = None) -> Record:
        if not self.queue:
            self.node.pump(WATCH_INTERVAL if timeout is None else timeout)
        if (record := self.try_peek()) is not None:
            return record
        raise BusyError("no reply yet")

    def release(self) -> None:
        self.queue.popleft()


class RemoteNode:
    """One node agent's connection and its ranks, as node 0's executor sees them."""

    def __init__(
        self,
        node_rank: int,
        sock: socket.socket,
        ranks: range,
        offset_ns: int,
        received: FrameBuffer,
    ) -> None:
        self.node_rank = node_rank
        self.sock = sock
        sock.setblocking(False)
        self.offset_ns = offset_ns
        self.received = received  # what came after the HELLO
        self.is_closed = False
        self.confirmed_ns = time.monotonic_ns()  # its ranks were alive then (our clock)
        self.ranks = [
            RankState(
                r, RemoteResults(self), self.confirmed_ns, f"worker rank {r} on node {node_rank}"
            )
            for r in ranks
        ]
        self._by_rank = {rank.rank: rank for rank in self.ranks}

    def close(self) -> None:
        self.is_closed = True
        self.sock.close()

    def is_undecided(self, since_ns: int) -> bool:
        """Whether one of its ranks may have failed before `since_ns` without our knowing."""
        if self.is_closed or any(rank.has_failed for rank in self.ranks):
            return False
        return self.confirmed_ns < since_ns

    def send(self, kind: int, data: bytes | bytearray, wait: Callable[[], None]) -> None:
        """Send one broadcast record; `wait()` runs between slices while the socket is full."""
        if self.is_closed:
            return
        view = memoryview(FRAME.pack(len(data), kind, -1, 0, time.monotonic_ns()) + data)
        while view:
            try:
                view = view[self.sock.send(view) :]
            except BlockingIOError:
                select.select([], [self.sock], [], WATCH_INTERVAL)
                self.pump()
                wait()
            except OSError as exc:
                self._lose(f"sending failed: {exc}")
                return

    def send_last(self, kind: int, data: bytes = b"") -> None:
        """Best effort, for CMD_SHUTDOWN: one send that never waits, then our end's FIN.

        The caller then reads until the agent closes (`pump` until `is_closed`): closing with
        its frames unread would send a reset, which can drop this record before it is read.
        """
        if not self.is_closed:
            with contextlib.suppress(OSError):
                self.sock.send(FRAME.pack(len(data), kind, -1, 0, time.monotonic_ns()) + data)
                self.sock.shutdown(socket.SHUT_WR)

    def pump(self, timeout: float = 0.0) -> None:
        """Read what has arrived (waiting up to `timeout` for something); never raises."""
        if self.is_closed:
            return
        if timeout > 0:
            select.select([self.sock], [], [], timeout)
        while True:
            try:
                data = self.sock.recv(1 << 20)
            except BlockingIOError:
                break
            except OSError as exc:
                self._lose(f"{exc}")
                break
            if not data:
                self._lose("end of stream")
                break
            self.received.data += data
        now = time.monotonic_ns()
        for kind, rank, sent_ns, payload in self.received.frames():
            self.offset_ns = min(self.offset_ns, now - sent_ns)
            self._handle(kind, rank, sent_ns + self.offset_ns, payload)

    def _handle(self, kind: int, rank_number: int, at_ns: int, payload: bytes) -> None:
        if kind == NODE_ALIVE:
            self.confirmed_ns = at_ns
            for each in self.ranks:
                if not each.has_failed:
                    each.alive_at_ns = at_ns
            return
        rank = self._by_rank.get(rank_number)
        if rank is None:
            return  # not ours: ignore rather than guess
        if kind == NODE_RANK_EXIT:
            returncode, alive_at_ns = RANK_EXIT.unpack(payload)
            rank.returncode = returncode
            rank.alive_at_ns = max(0, alive_at_ns + self.offset_ns)
            rank.take_failures(drain=True)
            return
        if kind == W.REPLY_FAILURE:  # its time onto our clock
            (failed_at,) = W.U64.unpack_from(payload)
            payload = W.U64.pack(max(0, failed_at + self.offset_ns)) + payload[W.U64.size :]
        assert isinstance(rank.results, RemoteResults)
        rank.results.queue.append((kind, memoryview(payload)))

    def _lose(self, reason: str) -> None:
        self.close()
        for rank in self.ranks:
            if not rank.has_failed:
                rank.alive_at_ns = self.confirmed_ns
                rank.lost = RemoteError(
                    rank.where,
                    "NodeLostError",
                    f"the connection to node {self.node_rank}'s agent closed ({reason}): "
                    f"the node, its agent or the network died",
                )
