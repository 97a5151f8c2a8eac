"""Node 0's side of nodes joining: the listener, every connection's handshake, the slots.

The executor listens on ``master_addr:master_port + 1`` before it starts its own ranks, then
`accept_nodes` challenges every connection at once (`_node_link.PendingHello`) and reads all
their HELLOs concurrently, each under one deadline for the whole HELLO. A connection that
does not prove the node token is dropped and logged (the first `MAX_LOGGED_DROPS`), counted
for the timeout's message, and never takes a slot: a node's slot is given only after its
proof, so nobody can lock the real node out or stall its join. A node that proved the token
but has other flags, or a rank already taken, is an operator's mistake and fails start-up.
"""

from __future__ import annotations

import contextlib
import math
import select
import socket
import time
from collections.abc import Callable
from typing import Final

from ...protocol._config import EngineConfig
from ._node_link import HELLO_TIMEOUT, MAX_LOGGED_DROPS, HelloRejected, NodeHello, PendingHello, log
from ._remote_nodes import LISTEN_PORT_OFFSET, WATCH_INTERVAL, FrameBuffer, RemoteNode

MAX_PENDING: Final = 32  # connections challenged at once; past it the oldest is dropped


class NodeJoinError(RuntimeError):
    """A node did not join (in time, or with the same flags); the message says what to run."""


def join_command(config: EngineConfig, node_rank: int) -> str:
    port = config.master_port
    link = " --insecure-node-link" if config.insecure_node_link else ""
    return (
        f"trillm serve {config.worker.model} --headless --node-rank {node_rank} --nnodes "
        f"{config.nnodes} --tensor-parallel-size {config.tensor_parallel_size} --master-addr "
        f"{config.master_addr} --master-port {port}{link}"
    )


def open_listener(config: EngineConfig) -> socket.socket:
    """The socket node agents connect to (``master_addr:master_port + 1``)."""
    assert config.master_port is not None
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        port = config.master_port + LISTEN_PORT_OFFSET
        try:
            listener.bind((config.master_addr, port))
        except OSError as exc:
            raise NodeJoinError(
                f"cannot listen for node agents on {config.master_addr}:{port} "
                f"(--master-port {config.master_port} + 1): {exc}"
            ) from None
        listener.listen(MAX_PENDING)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    return listener


class Drops:
    """Connections dropped before they joined: logged (the first few), counted."""

    def __init__(self) -> None:
        self.count = 0
        self.auth_failures = 0

    def drop(self, sock: socket.socket, peer: str, reason: HelloRejected) -> None:
        sock.close()
        self.count += 1
        self.auth_failures += reason.is_auth_failure
        if self.count <= MAX_LOGGED_DROPS:
            last = self.count == MAX_LOGGED_DROPS
            more = "; further drops are counted, not logged" if last else ""
            log(f"dropped a connection from {peer} before it joined: {reason}{more}")

    def summary(self) -> str:
        if not self.count:
            return ""
        proof = (
            f", {self.auth_failures} of them for a HELLO that did not prove the node token "
            "(every node needs the same one)"
            if self.auth_failures
            else ""
        )
        return f"; {self.count} connections to the node link were dropped{proof}"


def accept_nodes(
    listener: socket.socket,
    config: EngineConfig,
    stack: contextlib.ExitStack,
    sweep: Callable[[], None],
    *,
    key: bytes,
    hello_timeout: float = HELLO_TIMEOUT,
) -> list[RemoteNode]:
    """Every other node's agent, within `distributed_timeout`; `sweep()` runs every slice.

    Every connection is challenged at once and has `hello_timeout` for its whole HELLO; one
    that does not prove `key` (the node token) is dropped and logged, and never takes a
    node's slot. The connections of the nodes that joined go onto `stack`.

    Raises:
        NodeJoinError: a node did not join in time, or a node that proved the token has other
            flags or a node rank already taken.
    """
    nodes: dict[int, RemoteNode] = {}
    pending: list[PendingHello] = []
    drops = Drops()
    deadline = time.monotonic() + config.distributed_timeout
    try:
        while len(nodes) < config.nnodes - 1:
            now = time.monotonic()
            if now >= deadline:
                raise NodeJoinError(_missing(config, nodes) + drops.summary())
            for each in [p for p in pending if p.deadline <= now]:
                pending.remove(each)
                whole = f"no whole HELLO within {hello_timeout:g} s ({len(each.data)} bytes)"
                drops.drop(each.sock, each.peer, HelloRejected(whole))
            wait = min([deadline, *(p.deadline for p in pending)]) - now
            poll = select.poll()  # not select(): no FD_SETSIZE limit on the fd numbers
            for fd in (listener.fileno(), *(p.fileno() for p in pending)):
                poll.register(fd, select.POLLIN)
            timeout_ms = math.ceil(max(0.0, min(wait, WATCH_INTERVAL)) * 1000)
            readable = {fd for fd, _ in poll.poll(timeout_ms)}
            sweep()
            for each in [p for p in pending if p.fileno() in readable]:
                try:
                    joined = each.receive()
                except HelloRejected as exc:
                    pending.remove(each)
                    drops.drop(each.sock, each.peer, exc)
                    continue
                if joined is not None:
                    pending.remove(each)
                    _join(config, nodes, stack, each, *joined)
            if listener.fileno() in readable:
                _accept(listener, key, hello_timeout, pending, drops)
    finally:
        for each in pending:
            each.sock.close()
    return [nodes[k] for k in sorted(nodes)]


def _accept(
    listener: socket.socket,
    key: bytes,
    hello_timeout: float,
    pending: list[PendingHello],
    drops: Drops,
) -> None:
    """Challenge every connection waiting in the backlog."""
    while True:
        try:
            sock, address = listener.accept()
        except (BlockingIOError, ConnectionAbortedError):
            return
        peer = f"{address[0]}:{address[1]}"
        try:
            pending.append(PendingHello(sock, peer, key, time.monotonic() + hello_timeout))
        except HelloRejected as exc:
            drops.drop(sock, peer, exc)
        if len(pending) > MAX_PENDING:
            oldest = pending.pop(0)
            busy = HelloRejected(f"more than {MAX_PENDING} connections awaited their HELLO")
            drops.drop(oldest.sock, oldest.peer, busy)


def _join(
    config: EngineConfig,
    nodes: dict[int, RemoteNode],
    stack: contextlib.ExitStack,
    proved: PendingHello,
    hello: NodeHello,
    offset_ns: int,
) -> None:
    """Give a node that proved the token its slot, and welcome it.

    Raises:
        NodeJoinError: its flags differ from ours, or its node rank has joined already.
    """
    stack.callback(proved.sock.close)
    if (hello.nnodes, hello.tensor_parallel_size) != (
        config.nnodes,
        config.tensor_parallel_size,
    ) or not 0 < hello.node_rank < config.nnodes:
        raise NodeJoinError(
            f"node {hello.node_rank} joined with --nnodes {hello.nnodes} "
            f"--tensor-parallel-size {hello.tensor_parallel_size}, node 0 has --nnodes "
            f"{config.nnodes} --tensor-parallel-size {config.tensor_parallel_size}: "
            f"start every node with the same flags"
        )
    if hello.node_rank in nodes:
        raise NodeJoinError(
            f"node {hello.node_rank} joined twice (the second from {proved.peer}): one "
            "--node-rank each"
        )
    try:
        proved.sock.setblocking(True)
        proved.sock.settimeout(HELLO_TIMEOUT)
        proved.sock.sendall(proved.welcome())
    except OSError as exc:
        log(f"node {hello.node_rank} from {proved.peer} left before its welcome ({exc})")
        proved.sock.close()
        return
    k = hello.node_rank
    per_node = config.ranks_per_node
    ranks = range(k * per_node, (k + 1) * per_node)
    nodes[k] = RemoteNode(k, proved.sock, ranks, offset_ns, FrameBuffer())
    log(f"node {k} joined from {proved.peer}")


def _missing(config: EngineConfig, nodes: dict[int, RemoteNode]) -> str:
    missing = [k for k in range(1, config.nnodes) if k not in nodes]
    first = missing[0]
    token = "" if config.insecure_node_link else " with the same node token"
    return (
        f"node {first} of {config.nnodes} did not join within "
        f"{config.distributed_timeout:g} s (--distributed-timeout): start "
        f"`{join_command(config, first)}`{token}"
        + (f"; nodes {missing} are missing" if len(missing) > 1 else "")
    )
