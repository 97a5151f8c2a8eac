"""The node link's handshake: a node agent proves the shared node token before it joins.

The link (``master_addr:master_port + 1``, `_remote_nodes`) carries every step record in
clear, prompt token ids included, so node 0 lets a connection join only after it proved the
node token, and the agent trusts node 0 only after node 0 proved it back. Every frame is
`FRAME` (``[u32 payload length][u32 kind][i32 rank][u32 0][i64 sender's CLOCK_MONOTONIC
ns]``, 24 bytes, little-endian) plus its payload::

    node 0 -> agent  CHALLENGE  payload 36 bytes: [u32 LINK_VERSION][32 bytes server nonce]
    agent -> node 0  HELLO      payload 64 + n:   [32 bytes client nonce][32 bytes MAC]
                                                  [n bytes NodeHello msgpack]
    node 0 -> agent  WELCOME    payload 32 bytes: [32 bytes MAC']

    MAC  = HMAC-SHA256(token, HELLO_CONTEXT   + server nonce + client nonce + NodeHello)
    MAC' = HMAC-SHA256(token, WELCOME_CONTEXT + client nonce + server nonce + NodeHello)

The NodeHello (node rank, nnodes, tensor-parallel size) is under the MAC, so nobody can
claim another node's slot; the nonces make every MAC single-use; the two contexts keep one
side's MAC from serving as the other's. Node 0 takes a node's slot only once its MAC checked
out, and reads every connection's HELLO concurrently under one deadline for the whole HELLO
(`HELLO_TIMEOUT`), so a silent, dribbling or lying peer is dropped (and logged) without
delaying a real agent. `--insecure-node-link` keys the MACs with the empty token: anyone can
compute them, which keeps the wire the same and says so.

After the handshake the stream is neither encrypted nor integrity-protected: someone on the
path can still read prompts or inject frames. docs/deploy.md says how to keep the link on a
private network or a tunnel.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import sys
import time
from typing import Final

import msgspec

from ....common.node_token import NODE_TOKEN_ENV as NODE_TOKEN_ENV
from ....common.node_token import TOKEN_HINT as TOKEN_HINT
from ....common.node_token import NodeTokenError as NodeTokenError
from ....common.node_token import link_key as link_key
from ....common.node_token import node_token_from_environment as node_token_from_environment
from ....common.node_token import read_node_token as read_node_token
from ....common.node_token import without_node_token as without_node_token

FRAME: Final = struct.Struct("<IIiIq")
NODE_HELLO: Final = 201  # agent -> executor: client nonce, MAC, `NodeHello` msgpack
NODE_CHALLENGE: Final = 204  # executor -> agent, first frame: link version, server nonce
NODE_WELCOME: Final = 205  # executor -> agent: node 0's MAC; the node has joined
LINK_VERSION: Final = 1
CHALLENGE: Final = struct.Struct("<I32s")
NONCE_SIZE: Final = 32
MAC_SIZE: Final = 32
MAX_HELLO_PAYLOAD: Final = NONCE_SIZE + MAC_SIZE + 64  # a NodeHello is a few bytes
HELLO_CONTEXT: Final = b"trillm node-link v1 hello\x00"
WELCOME_CONTEXT: Final = b"trillm node-link v1 welcome\x00"
HELLO_TIMEOUT: Final = 10.0  # seconds a connection has for its whole HELLO
MAX_LOGGED_DROPS: Final = 16  # then drops are only counted (a flood must not flood the log)


class NodeLinkError(RuntimeError):
    """The peer is not node 0 (or not with our token): the agent must not serve it."""


class NodeLinkRefusedError(NodeLinkError):
    """Node 0 closed the connection during the handshake (it refused our HELLO, or was busy)."""


class NodeHello(msgspec.Struct, array_like=True, frozen=True):
    node_rank: int
    nnodes: int
    tensor_parallel_size: int


def hello_mac(key: bytes, server_nonce: bytes, client_nonce: bytes, body: bytes) -> bytes:
    return hmac.digest(key, HELLO_CONTEXT + server_nonce + client_nonce + body, hashlib.sha256)


def welcome_mac(key: bytes, server_nonce: bytes, client_nonce: bytes, body: bytes) -> bytes:
    return hmac.digest(key, WELCOME_CONTEXT + client_nonce + server_nonce + body, hashlib.sha256)


def frame(kind: int, payload: bytes = b"") -> bytes:
    return FRAME.pack(len(payload), kind, -1, 0, time.monotonic_ns()) + payload


def log(message: str) -> None:
    print(f"trillm node link: {message}", file=sys.stderr, flush=True)


class HelloRejected(Exception):
    """Why a connection is dropped before it joined; the message is for the log."""

    def __init__(self, reason: str, *, is_auth_failure: bool = False) -> None:
        super().__init__(reason)
        self.is_auth_failure = is_auth_failure


class PendingHello:
    """One accepted connection that has been challenged and has not proved itself yet.

    Never blocks: `receive` reads what has arrived, at most up to the end of the HELLO
    frame, so nothing the agent sends later is read here.
    """

    def __init__(self, sock: socket.socket, peer: str, key: bytes, deadline: float) -> None:
        self.sock = sock
        self.peer = peer
        self.key = key
        self.deadline = deadline  # for the whole HELLO, however it is cut into packets
        self.nonce = secrets.token_bytes(NONCE_SIZE)
        self.data = bytearray()
        self.client_nonce = b""
        self.body = b""
        sock.setblocking(False)
        try:
            sock.send(frame(NODE_CHALLENGE, CHALLENGE.pack(LINK_VERSION, self.nonce)))
        except OSError as exc:
            raise HelloRejected(f"the challenge could not be sent ({exc})") from None

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self) -> tuple[NodeHello, int] | None:
        """The proved HELLO and the clock offset (ours - theirs, ns), or None: not all yet.

        Raises:
            HelloRejected: the peer closed, sent something else, or failed the proof.
        """
        want = FRAME.size if len(self.data) < FRAME.size else self._frame_size()
        try:
            chunk = self.sock.recv(want - len(self.data))
        except BlockingIOError:
            return None
        except OSError as exc:
            raise HelloRejected(f"the connection failed ({exc})") from None
        if not chunk:
            raise HelloRejected(f"it closed the connection after {len(self.data)} bytes")
        self.data += chunk
        if len(self.data) < FRAME.size or len(self.data) < self._frame_size():
            return None
        _, _, _, _, sent_ns = FRAME.unpack_from(self.data)
        return self._check(bytes(self.data[FRAME.size :])), time.monotonic_ns() - sent_ns

    def welcome(self) -> bytes:
        """The WELCOME frame: node 0's proof, for a node that joined."""
        return frame(NODE_WELCOME, welcome_mac(self.key, self.nonce, self.client_nonce, self.body))

    def _frame_size(self) -> int:
        length, kind, _, _, _ = FRAME.unpack_from(self.data)
        if kind != NODE_HELLO:
            raise HelloRejected(
                f"its first frame is not a HELLO (kind {kind}, length {length}): not a node agent"
            )
        if not NONCE_SIZE + MAC_SIZE < length <= MAX_HELLO_PAYLOAD:
            raise HelloRejected(
                f"a HELLO of {length} bytes, not {NONCE_SIZE + MAC_SIZE + 1}.."
                f"{MAX_HELLO_PAYLOAD}: an agent of an older trillm (without node tokens) or "
                "no agent"
            )
        return FRAME.size + int(length)

    def _check(self, payload: bytes) -> NodeHello:
        client_nonce = payload[:NONCE_SIZE]
        mac = payload[NONCE_SIZE : NONCE_SIZE + MAC_SIZE]
        body = payload[NONCE_SIZE + MAC_SIZE :]
        if not hmac.compare_digest(mac, hello_mac(self.key, self.nonce, client_nonce, body)):
            raise HelloRejected(
                "its HELLO does not prove the node token (a different token, or none)",
                is_auth_failure=True,
            )
        try:
            hello = msgspec.msgpack.decode(body, type=NodeHello)
        except msgspec.DecodeError as exc:
            raise HelloRejected(f"its HELLO holds no NodeHello ({exc})") from None
        self.client_nonce, self.body = client_nonce, body
        return hello


def join_node0(
    sock: socket.socket,
    key: bytes,
    hello: NodeHello,
    *,
    challenge_deadline: float,
    hello_timeout: float = HELLO_TIMEOUT,
) -> None:
    """The agent's side of the handshake, on a connected socket; returns once node 0 proved
    the token back. Node 0 may challenge late (it listens while its own ranks start).

    Raises:
        NodeLinkRefusedError: node 0 closed the connection (our HELLO did not prove its token,
            our flags differ, or it dropped us): worth another try within the timeout.
        NodeLinkError: the peer is not node 0 of this token, or said nothing in time.
    """
    late = (
        "no challenge came within --distributed-timeout: node 0 is still starting its own "
        "ranks, or it is a trillm without node tokens"
    )
    kind, payload = _read_frame(sock, challenge_deadline, "a challenge", late)
    if kind != NODE_CHALLENGE or len(payload) != CHALLENGE.size:
        raise NodeLinkError(
            f"its first frame is no node-link challenge (kind {kind}, {len(payload)} bytes): "
            "it is not a trillm node 0, or an older one without node tokens"
        )
    version, server_nonce = CHALLENGE.unpack(payload)
    if version != LINK_VERSION:
        raise NodeLinkError(
            f"it speaks node-link version {version}, this node {LINK_VERSION}: run the same "
            "trillm on every node"
        )
    client_nonce = secrets.token_bytes(NONCE_SIZE)
    body = msgspec.msgpack.encode(hello)
    mac = hello_mac(key, server_nonce, client_nonce, body)
    try:
        sock.settimeout(hello_timeout)
        sock.sendall(frame(NODE_HELLO, client_nonce + mac + body))
    except OSError as exc:
        raise NodeLinkRefusedError(f"sending the HELLO failed ({exc})") from None
    late = f"no welcome came within {hello_timeout:g} s of the HELLO"
    kind, payload = _read_frame(sock, time.monotonic() + hello_timeout, "a welcome", late)
    expected = welcome_mac(key, server_nonce, client_nonce, body)
    if kind != NODE_WELCOME or not hmac.compare_digest(payload, expected):
        raise NodeLinkError(
            "its welcome does not prove the node token: it is not node 0, or node 0 has "
            "another token"
        )


def _read_frame(sock: socket.socket, deadline: float, what: str, late: str) -> tuple[int, bytes]:
    """One frame of at most 64 bytes of payload, all of it before `deadline` (else `late`)."""
    header = _read_exactly(sock, FRAME.size, deadline, what, late)
    length, kind, _, _, _ = FRAME.unpack(header)
    if length > 64:
        raise NodeLinkError(f"it sent a frame of {length} bytes instead of {what}")
    return kind, _read_exactly(sock, length, deadline, what, late)


def _read_exactly(sock: socket.socket, n: int, deadline: float, what: str, late: str) -> bytes:
    data = bytearray()
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise NodeLinkError(late)
        try:
            sock.settimeout(left)
            chunk = sock.recv(n - len(data))
        except TimeoutError:
            raise NodeLinkError(late) from None
        except OSError as exc:
            raise NodeLinkRefusedError(f"the connection failed before {what} ({exc})") from None
        if not chunk:
            raise NodeLinkRefusedError(f"it closed the connection before {what}")
        data += chunk
    return bytes(data)
