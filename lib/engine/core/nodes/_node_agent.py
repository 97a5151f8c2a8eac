"""A headless node's agent: runs this node's tensor-parallel ranks for node 0's executor.

``trillm serve MODEL --headless --node-rank K --nnodes N -tp T --master-addr A --master-port P``
is this process (no frontend, no engine). It connects to node 0's executor at ``A:P+1``
(retrying until ``--distributed-timeout``), proves the node token and says who it is (and
checks node 0's proof back: `_node_link`), then spawns global ranks ``K*L ..
K*L+L-1`` (L = T / N) on its own broadcast ring, and then loops, one thread, in
`WATCH_INTERVAL` slices: every record the executor sends goes into the ring (the ranks read
it in place, as on node 0); every record on a rank's result ring (LOAD and INIT_KV replies,
FAILURE records) goes back as a frame, then a rank's exit (its pidfd) as NODE_RANK_EXIT, then
NODE_ALIVE while every rank not reported is alive and not exiting. The wire is
`_remote_nodes`'s. CMD_SHUTDOWN, or the executor's connection closing, ends the agent: its
ranks get the shutdown (or a closed ring), `shutdown_timeout`, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import select
import socket
import sys
import time
from typing import Final

import trio

from ....common.process import is_exiting
from ....gpu import worker_process as W
from ....transport_shm import BusyError, RingReader, RingWriter
from ...protocol._config import EngineConfig
from ..executor._ranks import LocalRank, reap_exited, spawn_rank, worker_args
from ._node_link import (
    TOKEN_HINT,
    NodeHello,
    NodeLinkError,
    NodeLinkRefusedError,
    join_node0,
    link_key,
    log,
)
from ._remote_nodes import (
    FRAME,
    LISTEN_PORT_OFFSET,
    NODE_ALIVE,
    NODE_RANK_EXIT,
    RANK_EXIT,
    WATCH_INTERVAL,
    FrameBuffer,
)

CONNECT_RETRY: Final = 0.2  # seconds between attempts to reach node 0
REFUSED_RETRY: Final = 1.0  # ... after node 0 closed the connection during the handshake
SIDE_RING_CAPACITY: Final = 1 << 20


class NodeAgentError(RuntimeError):
    """The agent cannot serve: node 0 is unreachable or went away."""


def _frame(kind: int, payload: bytes | memoryview = b"", rank: int = -1, at_ns: int = 0) -> bytes:
    at_ns = at_ns or time.monotonic_ns()
    return FRAME.pack(len(payload), kind, rank, 0, at_ns) + bytes(payload)


def connect_to_node0(config: EngineConfig, key: bytes) -> socket.socket:
    """A connection to node 0's executor that passed the handshake, within
    `distributed_timeout`.

    Raises:
        NodeAgentError: nobody listened in time, node 0 kept refusing our HELLO, or what
            answered is not node 0 with our token.
    """
    assert config.master_port is not None
    address = (config.master_addr, config.master_port + LISTEN_PORT_OFFSET)
    where = f"{address[0]}:{address[1]}"
    hello = NodeHello(config.node_rank, config.nnodes, config.tensor_parallel_size)
    deadline = time.monotonic() + config.distributed_timeout
    refusals = 0
    while True:
        try:
            sock = socket.create_connection(address, timeout=WATCH_INTERVAL * 50)
        except OSError as exc:
            if time.monotonic() + CONNECT_RETRY > deadline:
                raise NodeAgentError(
                    f"node 0 did not answer at {where} within "
                    f"{config.distributed_timeout:g} s (--distributed-timeout; last error: "
                    f"{exc}): start node 0 (`trillm serve` with --node-rank 0), or check "
                    f"--master-addr and --master-port"
                ) from None
            time.sleep(CONNECT_RETRY)
            continue
        try:
            join_node0(sock, key, hello, challenge_deadline=deadline)
        except NodeLinkRefusedError as exc:
            sock.close()
            refusals += 1
            if time.monotonic() + REFUSED_RETRY > deadline:
                raise NodeAgentError(
                    f"node 0 at {where} refused this node's HELLO {refusals} times within "
                    f"{config.distributed_timeout:g} s (--distributed-timeout; last: {exc}): "
                    f"{TOKEN_HINT}, and the same --nnodes and --tensor-parallel-size; node 0's "
                    "log names the cause"
                ) from None
            time.sleep(REFUSED_RETRY)
            continue
        except NodeLinkError as exc:
            sock.close()
            raise NodeAgentError(f"the node link at {where} failed its handshake: {exc}") from None
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


class NodeAgent:
    """This node's ranks and the connection to node 0; `serve` returns the exit code."""

    def __init__(
        self, config: EngineConfig, sock: socket.socket, *, ring_capacity: int = 1 << 24
    ) -> None:
        self.config = config
        self.sock = sock
        self.received = FrameBuffer()
        self.exits = select.poll()
        self.reported: set[int] = set()  # ranks whose failure or exit went to node 0
        self.last_alive_ns = 0
        self.ring_is_broken = False
        self.has_shut_down = False  # CMD_SHUTDOWN went into the ring
        self.stack = contextlib.ExitStack()
        per_node = config.ranks_per_node
        first = config.node_rank * per_node
        master = f"tcp://{config.master_addr}:{config.master_port}"
        with self.stack:
            self.commands = self.stack.enter_context(
                RingWriter.create(ring_capacity, num_readers=per_node)
            )
            self.ranks: list[LocalRank] = []
            for index in range(per_node):
                capacity = ring_capacity if first + index == 0 else SIDE_RING_CAPACITY
                results = self.stack.enter_context(RingReader.create(capacity))
                args = worker_args(
                    config.worker,
                    rank=first + index,
                    world_size=config.tensor_parallel_size,
                    reader_index=index,
                    dist_init_method=master,
                    commands=self.commands.address,
                    results=results,
                )
                self.ranks.append(
                    spawn_rank(self.stack, self.exits, args, results, self.commands.address)
                )
            self.stack = self.stack.pop_all()

    def close(self, timeout: float) -> None:
        """Tell the ranks to exit, give them `timeout`, kill the rest, close everything."""
        try:
            if not (self.ring_is_broken or self.has_shut_down):
                with contextlib.suppress(trio.BrokenResourceError):
                    if self.commands.try_reserve(0) is not None:  # full: a rank is stuck
                        self.commands.commit(W.CMD_SHUTDOWN)
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0 and reap_exited(
                self.ranks, self.exits, left
            ):
                with contextlib.suppress(NodeAgentError):  # node 0 may be gone already
                    self._forward()
        finally:
            self.stack.close()
            self.sock.close()

    def serve(self) -> int:
        """Relay until CMD_SHUTDOWN (0) or the end of node 0's connection (1)."""
        self._wait_attached()
        while True:
            readable, _, _ = select.select([self.sock], [], [], WATCH_INTERVAL)
            if readable:
                try:
                    data = self.sock.recv(1 << 20)
                except OSError:
                    data = b""
                if not data:
                    print(
                        f"trillm node {self.config.node_rank}: node 0's engine closed the "
                        f"connection without a shutdown; stopping this node's ranks",
                        file=sys.stderr,
                        flush=True,
                    )
                    return 1
                self.received.data += data
                for kind, _, _, payload in self.received.frames():
                    self._write(kind, payload)
                    if kind == W.CMD_SHUTDOWN:
                        self.has_shut_down = True
                        return 0
            self._forward()

    def _wait_attached(self) -> None:
        """Until every live rank attached its rings (then their names are unlinked)."""
        rings: list[RingReader | RingWriter] = [self.commands]
        rings += [rank.ring for rank in self.ranks if rank.ring is not None]
        for ring in rings:
            while not any(rank.returncode is not None for rank in self.ranks):
                try:
                    ring.wait_attached(WATCH_INTERVAL)
                    break
                except BusyError:
                    self._forward()
                except trio.BrokenResourceError:
                    break

    def _write(self, kind: int, payload: bytes) -> None:
        """Put one command into this node's broadcast ring, forwarding replies meanwhile."""
        while not self.ring_is_broken:
            try:
                view = self.commands.reserve(len(payload), WATCH_INTERVAL)
            except BusyError:
                self._forward()
                continue
            except trio.BrokenResourceError:  # a rank is exiting: its exit is reported
                self.ring_is_broken = True
                return
            view[:] = payload
            self.commands.commit(kind)
            return

    def _forward(self) -> None:
        """Send every rank's replies, then exits, then ALIVE if all unreported ranks live."""
        for rank in self.ranks:
            self._forward_results(rank)
        now = time.monotonic_ns()
        ready = {fd for fd, _ in self.exits.poll(0)}
        all_alive = True
        for rank in self.ranks:
            if rank.returncode is not None or rank.process is None:
                continue
            if rank.pidfd in ready:
                self.exits.unregister(rank.pidfd)
                rank.returncode = rank.process.wait()
                self._forward_results(rank)
                exit_record = RANK_EXIT.pack(rank.returncode, rank.alive_at_ns)
                self._send(_frame(NODE_RANK_EXIT, exit_record, rank.rank))
                self.reported.add(rank.rank)
            elif is_exiting(rank.process.pid):
                all_alive = all_alive and rank.rank in self.reported
            else:
                rank.alive_at_ns = now
        if all_alive and now - self.last_alive_ns >= WATCH_INTERVAL * 1e9:
            self._send(_frame(NODE_ALIVE, at_ns=now))
            self.last_alive_ns = now

    def _forward_results(self, rank: LocalRank) -> None:
        ring = rank.results
        while True:
            try:
                record = ring.try_peek()
            except trio.BrokenResourceError:
                return
            if record is None:
                return
            kind, payload = record
            self._send(_frame(kind, payload, rank.rank))
            if kind == W.REPLY_FAILURE:
                self.reported.add(rank.rank)
            ring.release()

    def _send(self, frame: bytes) -> None:
        try:
            self.sock.sendall(frame)
        except OSError as exc:
            raise NodeAgentError(f"node 0's connection broke: {exc}") from None


def run_node_agent(
    config: EngineConfig, *, node_token: bytes | None = None, shutdown_timeout: float = 5.0
) -> int:
    """Serve this node's ranks for node 0's engine until it shuts down; the exit code.

    An engine that goes away without CMD_SHUTDOWN (it died; its frontend may start another)
    ends this node's ranks too; the agent then waits `distributed_timeout` for the next
    engine to connect, with fresh ranks.

    Args:
        node_token: the secret every node shares (None: only with `insecure_node_link`).

    Raises:
        NodeTokenError: no token, and no `insecure_node_link` either.
        NodeAgentError: node 0 is unreachable (within `distributed_timeout`), went away, or
            did not pass the handshake.
    """
    key = link_key(config.nnodes, node_token, insecure=config.insecure_node_link)
    if config.insecure_node_link:
        log("joining without a node token (--insecure-node-link): anyone can pose as node 0")
    while True:
        sock = connect_to_node0(config, key)
        sock.settimeout(config.distributed_timeout)  # sendall to a node 0 that stopped reading
        try:
            agent = NodeAgent(config, sock)
        except BaseException:
            sock.close()
            raise
        try:
            if agent.serve() == 0:
                return 0
        except NodeAgentError as exc:
            print(f"trillm node {config.node_rank}: {exc}", file=sys.stderr, flush=True)
        finally:
            agent.close(shutdown_timeout)
        print(
            f"trillm node {config.node_rank}: waiting up to {config.distributed_timeout:g} s "
            f"for node 0's next engine",
            file=sys.stderr,
            flush=True,
        )
