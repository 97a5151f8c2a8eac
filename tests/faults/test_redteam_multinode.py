"""Red team of the node link (--master-port + 1): whoever reaches it without the node token
neither joins nor stops node 0's start-up, and the real node still joins after them.

Most cases run node 0's accept loop (`accept_nodes`, as the executor runs it) on a thread
and the agent's real handshake (`connect_to_node0`) against it, over real sockets on
127.0.0.1, with no worker processes; the last one runs two `trillm serve` processes.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

import httpx
import msgspec
import pytest

from trillm.cli import main
from trillm.engine.core.nodes._node_agent import NodeAgentError, connect_to_node0
from trillm.engine.core.nodes._node_join import NodeJoinError, accept_nodes, open_listener
from trillm.engine.core.nodes._node_link import (
    CHALLENGE,
    FRAME,
    NODE_CHALLENGE,
    NODE_HELLO,
    NODE_TOKEN_ENV,
    NodeHello,
    NodeLinkRefusedError,
    NodeTokenError,
    frame,
    hello_mac,
    join_node0,
    link_key,
    read_node_token,
)
from trillm.engine.core.nodes._remote_nodes import FrameBuffer, RemoteNode
from trillm.engine.protocol import EngineConfig
from trillm.gpu import WorkerConfig

from ..http.conftest import wait_healthy
from .http_harness import tiny_model_dir
from .proc_harness import served
from .test_multinode import START_TIMEOUT, free_port_pair

TOKEN = b"red-team-node-token-0123456789ab"
HELLO_TIMEOUT = 1.5  # node 0's whole-HELLO deadline in these cases
BOUND = 20.0  # seconds any one wait below may take, on a slow machine with busy cores


def cluster(
    port: int, *, node_rank: int = 0, timeout: float = 60.0, insecure: bool = False
) -> EngineConfig:
    return EngineConfig(
        node_rank=node_rank,
        worker=WorkerConfig("unused"),
        tensor_parallel_size=2,
        nnodes=2,
        master_addr="127.0.0.1",
        master_port=port,
        distributed_timeout=timeout,
        insecure_node_link=insecure,
    )


class Node0:
    """Node 0's accept loop on a thread: its listener, then the nodes that joined or the
    error that ended it."""

    def __init__(self, config: EngineConfig, key: bytes, hello_timeout: float) -> None:
        self.config = config
        assert config.master_port is not None
        self.address = ("127.0.0.1", config.master_port + 1)
        self.stack = ExitStack()
        self.listener = self.stack.enter_context(open_listener(config))
        self.nodes: list[RemoteNode] = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(key, hello_timeout), daemon=True)
        self.thread.start()

    def _run(self, key: bytes, hello_timeout: float) -> None:
        try:
            self.nodes = accept_nodes(
                self.listener, self.config, self.stack, lambda: None, key=key,
                hello_timeout=hello_timeout,
            )  # fmt: skip
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def joined(self) -> list[RemoteNode]:
        assert self.done.wait(BOUND), "node 0 is still waiting"
        if self.error is not None:
            raise self.error
        return self.nodes

    def close(self) -> None:
        self.thread.join(BOUND)
        self.stack.close()


@contextmanager
def node0(
    *, key: bytes = TOKEN, hello_timeout: float = HELLO_TIMEOUT, timeout: float = 60.0
) -> Iterator[Node0]:
    node = Node0(cluster(free_port_pair(), timeout=timeout), key, hello_timeout)
    try:
        yield node
    finally:
        node.close()


def connect(node: Node0) -> socket.socket:
    sock = socket.create_connection(node.address, timeout=BOUND)
    sock.settimeout(BOUND)
    return sock


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything node 0 sent before it dropped us, and when the drop came."""
    data = bytearray()
    with suppress(ConnectionResetError):
        while chunk := sock.recv(4096):
            data += chunk
    return bytes(data), time.monotonic()


def only_a_challenge(data: bytes) -> bool:
    """Whether what node 0 sent is its challenge and nothing else (no step, no welcome)."""
    if len(data) != FRAME.size + CHALLENGE.size:
        return False
    length, kind, _, _, _ = FRAME.unpack_from(data)
    return (length, kind) == (CHALLENGE.size, NODE_CHALLENGE)


def challenge_of(sock: socket.socket) -> bytes:
    data = b""
    while len(data) < FRAME.size + CHALLENGE.size:
        data += sock.recv(FRAME.size + CHALLENGE.size - len(data))
    assert only_a_challenge(data)
    nonce: bytes = CHALLENGE.unpack_from(data, FRAME.size)[1]
    return nonce


def the_real_node_joins(node: Node0, key: bytes = TOKEN) -> None:
    """Node 1's agent handshake succeeds, node 0 gives it the slot, and the connection it
    holds for node 1 is this one: a step record node 0 sends arrives here."""
    sock = connect_to_node0(msgspec.structs.replace(node.config, node_rank=1), key)
    try:
        (joined,) = node.joined()
        assert joined.node_rank == 1
        joined.send(7, b"the step", lambda: None)
        sock.settimeout(BOUND)
        received = FrameBuffer()
        while (got := received.next_frame()) is None:
            received.data += sock.recv(4096)
        assert (got[0], got[3]) == (7, b"the step")
    finally:
        sock.close()


# -- what the red team sends ---------------------------------------------------------------


def old_hello() -> bytes:
    """The HELLO of trillm before node tokens: 24 bytes of frame, 4 of NodeHello msgpack."""
    body = msgspec.msgpack.encode(NodeHello(1, 2, 2))
    data = FRAME.pack(len(body), NODE_HELLO, -1, 0, time.monotonic_ns()) + body
    assert len(data) == 28
    return data


def silent(sock: socket.socket) -> None:
    pass


def sends(data: bytes) -> Callable[[socket.socket], None]:
    return lambda sock: sock.sendall(data)


def forged_hello(key: bytes | None) -> Callable[[socket.socket], None]:
    """A HELLO of the right shape claiming node 1, its MAC keyed with `key` (None: 32 zero
    bytes), not with the token."""

    def send(sock: socket.socket) -> None:
        server_nonce = challenge_of(sock)
        client_nonce = os.urandom(32)
        body = msgspec.msgpack.encode(NodeHello(1, 2, 2))
        mac = bytes(32) if key is None else hello_mac(key, server_nonce, client_nonce, body)
        sock.sendall(frame(NODE_HELLO, client_nonce + mac + body))

    return send


def wrong_token(sock: socket.socket) -> None:
    """The agent's own handshake, keyed with another token."""
    with pytest.raises(NodeLinkRefusedError, match="it closed the connection before a welcome"):
        join_node0(
            sock, b"another-token-0123456789abcdef", NodeHello(1, 2, 2),
            challenge_deadline=time.monotonic() + BOUND,
        )  # fmt: skip


ATTACKS = {
    "raw-socket-silent": silent,
    "old-28-byte-hello": sends(old_hello()),
    "http-garbage": sends(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256))),
    "hello-of-4-GiB": sends(FRAME.pack(0xFFFFFFFF, NODE_HELLO, -1, 0, 0)),
    "half-a-header": sends(b"\xc9\x00\x00"),
    "zero-mac-claiming-node-1": forged_hello(None),
    "mac-of-the-empty-key": forged_hello(b""),
    "mac-of-a-guessed-token": forged_hello(TOKEN[:-1]),
    "wrong-token": wrong_token,
}


@pytest.mark.parametrize("attack", ATTACKS.values(), ids=ATTACKS.keys())
def test_an_unauthenticated_peer_is_dropped_and_the_real_node_joins_after_it(
    attack: Callable[[socket.socket], None], capfd: pytest.CaptureFixture[str]
) -> None:
    with node0() as node:
        sock = connect(node)
        try:
            attack(sock)
            data, _ = read_until_closed(sock)  # node 0 dropped it ...
        finally:
            sock.close()
        assert data == b"" or only_a_challenge(data), data  # ... having told it nothing
        assert not node.done.is_set(), node.error  # start-up goes on
        the_real_node_joins(node)
    log = capfd.readouterr().err
    assert "trillm node link: dropped a connection from 127.0.0.1:" in log
    assert "trillm node link: node 1 joined from 127.0.0.1:" in log


def test_a_peer_dribbling_a_byte_a_second_is_dropped_at_the_whole_hello_deadline() -> None:
    """The deadline is for the whole HELLO: a peer that sends a byte a second (each recv
    would get one within any per-recv timeout) is dropped at it all the same."""
    hello = old_hello()
    with node0(hello_timeout=2.0) as node:
        sock = connect(node)
        stop = threading.Event()
        sent: list[float] = []

        def dribble() -> None:
            for byte in hello:
                if stop.wait(1.0):
                    return
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    return
                sent.append(time.monotonic())

        dribbler = threading.Thread(target=dribble, daemon=True)
        started = time.monotonic()
        dribbler.start()
        try:
            data, dropped_at = read_until_closed(sock)
        finally:
            stop.set()
            dribbler.join(BOUND)
            sock.close()
        assert only_a_challenge(data)
        assert 2.0 <= dropped_at - started < 2.0 + BOUND
        assert 1 <= len(sent) < len(hello)  # it was still sending when it was dropped
        assert not node.done.is_set(), node.error
        the_real_node_joins(node)


def test_a_dribbling_peer_does_not_delay_the_real_node() -> None:
    """HELLOs are read concurrently: the real node joins while a dribbler is mid-HELLO."""
    with node0(hello_timeout=60.0) as node:
        dribbler = connect(node)
        try:
            dribbler.sendall(old_hello()[:3])
            started = time.monotonic()
            the_real_node_joins(node)
            assert time.monotonic() - started < BOUND  # not after the dribbler's 60 s
        finally:
            dribbler.close()


def test_a_fake_node_1_does_not_lock_out_the_real_one() -> None:
    """A forged HELLO claiming node 1 takes no slot: the real node 1 is not 'joined twice'."""
    with node0() as node:
        fakes = [connect(node) for _ in range(3)]
        try:
            for fake in fakes:
                forged_hello(None)(fake)
            for fake in fakes:
                assert read_until_closed(fake)[0] == b""  # nothing after the challenge
        finally:
            for fake in fakes:
                fake.close()
        the_real_node_joins(node)


def test_a_flood_of_silent_connections_does_not_keep_the_real_node_out() -> None:
    with node0(hello_timeout=60.0) as node:
        flood = [connect(node) for _ in range(40)]  # more than node 0 challenges at once
        try:
            the_real_node_joins(node)
        finally:
            for each in flood:
                each.close()


def test_a_node_with_another_token_gives_up_and_node_0_names_the_cause() -> None:
    with node0(timeout=3.0) as node:
        agent = cluster(node.config.master_port or 0, node_rank=1, timeout=2.0)
        message = (
            f"node 0 at 127.0.0.1:{node.address[1]} refused this node's HELLO <N> times within "
            "2 s (--distributed-timeout; last: it closed the connection before a welcome): "
            "give every node the same secret with --node-token-file FILE or the environment "
            f"variable {NODE_TOKEN_ENV} (e.g. `openssl rand -hex 32`), and the same --nnodes "
            "and --tensor-parallel-size; node 0's log names the cause"
        )
        with pytest.raises(NodeAgentError, match=r"\d+".join(map(re.escape, message.split("<N>")))):
            connect_to_node0(agent, b"another-token-0123456789abcdef")
        with pytest.raises(NodeJoinError) as error:
            node.joined()
    text = str(error.value)
    assert text.startswith(
        "node 1 of 2 did not join within 3 s (--distributed-timeout): start `trillm serve unused "
        "--headless --node-rank 1 --nnodes 2 --tensor-parallel-size 2 --master-addr 127.0.0.1 "
        f"--master-port {node.config.master_port}` with the same node token; "
    ), text
    assert re.search(
        r"; (\d+) connections to the node link were dropped, \1 of them for a HELLO that did "
        r"not prove the node token \(every node needs the same one\)$",
        text,
    ), text


def test_an_impostor_node_0_is_refused_by_the_agent() -> None:
    """The agent checks node 0's proof too: a listener without the token gets no service."""
    port = free_port_pair()
    with socket.create_server(("127.0.0.1", port + 1)) as impostor:

        def pose() -> None:
            sock, _ = impostor.accept()
            with sock:
                sock.sendall(frame(NODE_CHALLENGE, CHALLENGE.pack(1, os.urandom(32))))
                sock.recv(4096)  # the agent's HELLO
                sock.sendall(frame(205, bytes(32)))  # a WELCOME that proves nothing
                sock.recv(4096)

        poser = threading.Thread(target=pose, daemon=True)
        poser.start()
        message = (
            f"the node link at 127.0.0.1:{port + 1} failed its handshake: its welcome does not "
            "prove the node token: it is not node 0, or node 0 has another token"
        )
        with pytest.raises(NodeAgentError, match=re.escape(message)):
            connect_to_node0(cluster(port, node_rank=1, timeout=BOUND), TOKEN)
        poser.join(BOUND)


def test_an_agent_meeting_an_old_node_0_says_so() -> None:
    """A node 0 of before node tokens waits for a HELLO and sends no challenge."""
    port = free_port_pair()
    with socket.create_server(("127.0.0.1", port + 1)):  # the kernel accepts; no one speaks
        message = (
            f"the node link at 127.0.0.1:{port + 1} failed its handshake: no challenge came "
            "within --distributed-timeout: node 0 is still starting its own ranks, or it is a "
            "trillm without node tokens"
        )
        with pytest.raises(NodeAgentError, match=re.escape(message)):
            connect_to_node0(cluster(port, node_rank=1, timeout=1.0), TOKEN)


def test_an_insecure_link_lets_any_agent_join_and_says_so() -> None:
    with node0(key=link_key(2, None, insecure=True)) as node:
        the_real_node_joins(node, key=b"")


# -- the token: where it comes from, and the policy without one -----------------------------


def test_the_token_is_read_from_the_flag_the_file_or_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(b"  from-the-file-0123456789\n")
    path.chmod(0o600)
    env = {NODE_TOKEN_ENV: "from-the-environment-0123"}
    assert read_node_token(None, str(path), env) == b"from-the-file-0123456789"
    assert read_node_token("from-the-flag-0123456789", None, env) == b"from-the-flag-0123456789"
    assert read_node_token(None, None, env) == b"from-the-environment-0123"
    assert read_node_token(None, None, {}) is None


BAD_TOKENS = [
    (("0123456789abcdef", "FILE"), "give one of --node-token and --node-token-file, not both"),
    (("short", None), "the node token of --node-token is 5 bytes; it must be at least 16"),
    ((None, "MISSING"), "cannot read the node token: --node-token-file MISSING: No such file"),
    ((None, "EMPTY"), "the node token of --node-token-file EMPTY is 0 bytes; it must be at least"),
    ((None, "BINARY"), "the node token of --node-token-file BINARY is not text (UTF-8 without"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "message"), BAD_TOKENS)
def test_a_bad_token_is_refused_naming_where_it_came_from(
    tmp_path: Path, flags: tuple[str | None, str | None], message: str
) -> None:
    files = {"FILE": b"0123456789abcdef", "EMPTY": b"\n", "BINARY": os.urandom(16) + b"\xff"}
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    token, file = flags
    path = None if file is None else str(tmp_path / file)
    with pytest.raises(NodeTokenError, match=re.escape(message.replace(file or "@", path or ""))):
        read_node_token(token, path, {})


def test_a_token_file_others_can_read_is_warned_about(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "token"
    path.write_bytes(b"0123456789abcdef0123")
    path.chmod(0o644)
    assert read_node_token(None, str(path), {}) == b"0123456789abcdef0123"
    assert f"is readable by other users (mode 644); `chmod 600 {path}`" in capfd.readouterr().err
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # told, not changed


NODE_FLAGS = ("--nnodes", "2", "-tp", "2", "--master-port", "3000")
NO_TOKEN = (
    "trillm serve: --nnodes 2 needs a node token: the node link (--master-port + 1) carries "
    "every prompt and would otherwise let anyone join as a node; give every node the same "
    f"secret with --node-token-file FILE or the environment variable {NODE_TOKEN_ENV} (e.g. "
    "`openssl rand -hex 32`), or pass --insecure-node-link on a network only your nodes can "
    "reach"
)


@pytest.mark.parametrize("rank", [(), ("--headless", "--node-rank", "1")], ids=["node0", "node1"])
def test_several_nodes_without_a_token_are_refused_before_anything_starts(
    rank: tuple[str, ...], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(NODE_TOKEN_ENV, raising=False)
    started = time.monotonic()
    assert main(["serve", "unused-model", *NODE_FLAGS, *rank]) == 1
    assert time.monotonic() - started < BOUND  # nothing was started, nothing waited for
    assert NO_TOKEN in capsys.readouterr().err


def test_a_token_with_the_insecure_opt_out_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NODE_TOKEN_ENV, "0123456789abcdef")
    assert main(["serve", "unused-model", *NODE_FLAGS, "--insecure-node-link"]) == 1
    assert "--insecure-node-link with a node token" in capsys.readouterr().err


# -- two real nodes ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


def attack_when_listening(
    address: tuple[str, int], attack: Callable[[socket.socket], None]
) -> bytes:
    """Connect once node 0 listens, attack, and return what it sent before dropping us."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            sock = socket.create_connection(address, timeout=START_TIMEOUT)
            break
        except OSError:
            assert time.monotonic() < deadline, "node 0 never listened"
            time.sleep(0.2)
    with sock:
        sock.settimeout(START_TIMEOUT)
        attack(sock)
        return read_until_closed(sock)[0]


@pytest.mark.slow
def test_two_serve_processes_join_through_red_team_peers(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 0 (token from a file) is attacked before node 1 (token from the environment)
    exists; it neither aborts nor admits anyone, node 1 then joins and serves, and the token
    is in no command line and in no worker rank's environment."""
    token_file = tmp_path / "node-token"
    token_file.write_bytes(TOKEN + b"\n")
    token_file.chmod(0o600)
    port = free_port_pair()
    args = (
        "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(port), "--distributed-timeout", str(START_TIMEOUT),
    )  # fmt: skip
    monkeypatch.delenv(NODE_TOKEN_ENV, raising=False)
    with ExitStack() as stack:
        node0 = stack.enter_context(
            served(model, *args, "--node-token-file", str(token_file), healthy=False)
        )
        for name in ("old-28-byte-hello", "http-garbage", "zero-mac-claiming-node-1"):
            sent = attack_when_listening(("127.0.0.1", port + 1), ATTACKS[name])
            assert sent == b"" or only_a_challenge(sent), (name, sent)
        assert node0.process.poll() is None, node0.output()
        monkeypatch.setenv(NODE_TOKEN_ENV, TOKEN.decode())
        node1 = stack.enter_context(
            served(model, *args, "--headless", "--node-rank", "1", healthy=False)
        )
        wait_healthy(node0.process, node0.base_url, START_TIMEOUT, lambda: f":\n{node0.output()}")
        body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{node0.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        output = node0.output()
        assert output.count("trillm node link: dropped a connection from 127.0.0.1:") == 3
        assert "does not prove the node token" in output
        assert "trillm node link: node 1 joined from 127.0.0.1:" in output
        tree = node0.tree() + node1.tree()
        cmdlines = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in tree}
        ranks = [pid for pid, line in cmdlines.items() if line.startswith(b"trillm::worker_")]
        assert len(ranks) == 2, cmdlines
        assert not [pid for pid, line in cmdlines.items() if TOKEN in line]
        for pid in ranks:
            assert NODE_TOKEN_ENV.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
