"""Case 14: what a client can reach.

The default bind is loopback; with `--api-key` every route but /health needs the key, compared
in constant time; the shared memory between frontend and engine is mode 0600 (whatever the
umask) under a random name that is unlinked once both ends are attached; and nothing a client
sends is unpickled or executed (no pickle, marshal, eval or exec anywhere in the request path,
no client-supplied chat template, template syntax in a message stays text).
"""

from __future__ import annotations

import ast
import hmac
import os
import re
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import trillm
from trillm.cli import build_parser
from trillm.http.edge._app import App
from trillm.http.edge._config import ServeConfig
from trillm.http.edge._errors import RequestError
from trillm.http.metrics._metrics import Metrics
from trillm.http.openai._requests import ChatCompletionRequest, CompletionRequest, template_kwargs

from ..http.conftest import Server
from ..procs import children
from .figures import record
from .http_harness import null_args, port_of, serving, tiny_model_dir

KEY = "sk-trillm-0123456789abcdef"
ROUTES = [
    ("GET", "/version"),
    ("GET", "/v1/models"),
    ("GET", "/metrics"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
]
BODIES: dict[str, Any] = {
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # No --host: the default bind is under test. Umask 0: the segments' mode must not follow it.
    model = tiny_model_dir(tmp_path_factory)
    with serving(model, *null_args(0.0), "--api-key", KEY, umask=0) as server:
        yield server


def listening_addresses(port: int) -> list[str]:
    """The local addresses with a listening TCP socket on `port` (IPv4 and IPv6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port_hex = local.split(":")
                if state == "0A" and int(port_hex, 16) == port:
                    found.append(address)
    return found


def test_the_default_bind_is_loopback_only(server: Server) -> None:
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"
    assert listening_addresses(port_of(server)) == ["0100007F"]  # 127.0.0.1, no IPv6, no 0.0.0.0


def test_every_route_but_health_needs_the_api_key(server: Server) -> None:
    wrong = [
        None,
        "",
        f"Bearer {KEY[:-1]}",
        f"Bearer {KEY[:-1]}X",
        f"Bearer {KEY}X",
        f"bearer {KEY}",
        KEY,
        f"Basic {KEY}",
    ]
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        assert client.get("/health").status_code == 200
        for method, path in ROUTES:
            body = BODIES.get(path)
            for header in wrong:
                headers = {} if header is None else {"Authorization": header}
                r = client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (method, path, header, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert r.headers["www-authenticate"] == "Bearer"
            ok = client.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
            assert ok.status_code == 200, (method, path, ok.text)
        # Timing of a wrong key that differs in its first byte or in its last: the compare
        # must not tell them apart (HTTP noise is far larger than any difference; recorded).
        timings: dict[str, list[float]] = {"first": [], "last": []}
        for _ in range(100):
            for where, key in (("first", "X" + KEY[1:]), ("last", KEY[:-1] + "X")):
                started = time.perf_counter()
                client.get("/version", headers={"Authorization": f"Bearer {key}"})
                timings[where].append(time.perf_counter() - started)
    first, last = (statistics.median(timings[w]) * 1e6 for w in ("first", "last"))
    record(14, "401 for a key wrong in its first byte vs its last, median", first - last, "us")


def test_the_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def compare_digest(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)  # this only watches it being used

    monkeypatch.setattr("trillm.http.edge._app.hmac.compare_digest", compare_digest)
    app = App(None, ServeConfig("tiny", api_key=KEY), Metrics("tiny"))  # type: ignore[arg-type]
    scope = {"method": "GET", "path": "/version", "headers": [(b"authorization", b"Bearer x")]}
    with pytest.raises(RequestError, match="the API key is missing or invalid"):
        app._route(scope)
    # Both headers are compared, every time: which one was sent must not change the time.
    assert compared == [(b"Bearer x", f"Bearer {KEY}".encode()), (b"", KEY.encode())]


def test_shared_memory_is_private_unguessable_and_unlinked(server: Server) -> None:
    frontend = server.process.pid
    (engine,) = children(frontend)
    names = set()
    for pid in (frontend, engine):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:
                continue
            if not target.startswith("/dev/shm/"):
                continue
            match = re.fullmatch(r"/dev/shm/trillm-(\d+)-([0-9a-f]{16}) \(deleted\)", target)
            assert match is not None, target  # named by creator pid and 64 random bits
            assert int(match[1]) == frontend
            mode = os.stat(f"/proc/{pid}/fd/{fd}").st_mode & 0o777
            assert mode == 0o600, (target, oct(mode))  # the server ran with umask 0
            names.add(match[2])
    assert len(names) == 2  # the request ring and the output ring, each its own random name
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"trillm-{frontend}-")]
    record(14, "shared-memory segments open, all mode 0600 and unlinked", len(names), "")


FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}


def test_no_pickle_or_code_execution_in_the_request_path() -> None:
    root = Path(trillm.__file__).parent
    offences = []
    for package in ("http", "engine", "transport_shm"):
        for path in sorted((root / package).rglob("*.py")):  # engine/client, core, ...
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    names = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
                    offences += [
                        f"{path.name}: import {n}"
                        for n in names
                        if n.split(".")[0] in FORBIDDEN_MODULES
                    ]
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in FORBIDDEN_CALLS
                ):
                    offences.append(f"{path.name}:{node.lineno}: {node.func.id}()")
    assert offences == []
    # A client cannot send a chat template (it would be code, even in jinja's sandbox); tools
    # are data the server renders itself (`_tools.tool_system_prompt`), never template code.
    # chat_template_kwargs are variables (data the template prints), and may not name the
    # template call's own arguments: a chat_template among them is a 400.
    for kind in (CompletionRequest, ChatCompletionRequest):
        assert "chat_template" not in kind.__struct_fields__
    with pytest.raises(RequestError, match="may not set 'chat_template'"):
        template_kwargs({"chat_template": "{{ 7 * 7 }}"})


def test_template_syntax_in_a_message_stays_text(server: Server) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    content = "{{ 7 * 7 }} {% for x in range(3) %}{{ x }}{% endfor %} {{ ''.__class__ }}"
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=30) as client:
        tokens = client.post("/tokenize", json={"messages": [{"role": "user", "content": content}]})
        assert tokens.status_code == 200
        text = client.post("/detokenize", json={"tokens": tokens.json()["tokens"]}).json()
    assert content in text["prompt"]
    assert "49" not in text["prompt"].replace(content, "")
