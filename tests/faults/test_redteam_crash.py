"""Issue 25, item 1: one request must not take the API process down, and if something does,
`trillm serve` (the supervisor) starts it again.

- The red team's requests (a Lark chain of 3,000 rules; a `response_format` whose `$defs`
  chain 3,000 `$ref`s; 100,000 links; a regex of 16,000 `a?`) are 400s naming the limit and
  the value, and the same API process serves on.
- With the depth budget raised to admit the 3,000 links, the API process checks them on its
  large stack and lives (what the engine's 8 MiB compile threads make of them is the
  engine's death, resumed and then failed as poison: engine restarts, not this issue).
- A crash planted in the API process (`POST /crash`: SIGSEGV, SIGKILL, an uncaught
  exception) is survived: the cause is logged, the open requests' connections close, a
  request sent meanwhile waits in the parent's socket and is served by the next child, and
  past `--max-api-restarts` the supervisor exits 1.
- SIGKILL of the supervisor leaves no process; an engine death or a start-up failure is not
  an API crash: the supervisor exits 1 with the child, without restarting it.

(SIGTERM and SIGINT through the supervisor: tests/faults/test_http_shutdown.py, "supervised".)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ..http.conftest import serve_command
from ..procs import children, is_dead
from .http_harness import null_args, scrape, tiny_model_dir
from .proc_harness import Served, served, shm_names_of, wait_dead, wait_for

SUPERVISED = ("--max-api-restarts", "3")
# The null executor at 50 tokens/s: a stream of 400 tokens is still open when the crash comes.
CRASH_FLAGS = (*SUPERVISED, "--enable-dev-endpoints", *null_args(0.02))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


def rule_chain(n: int) -> str:
    rules = [f'r{i}: "a" r{i + 1} | "b" r{i + 1} | "c"' for i in range(n)]
    return "\n".join(["start: r0", *rules, f'r{n}: "z"'])


def ref_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {
        f"d{i}": {"anyOf": [{"type": "integer"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(n)
    }
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def sdk(server: Served, max_retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=max_retries, timeout=120
    )


def api_pid(server: Served) -> int:
    """The supervisor's one child: the API server process."""
    (pid,) = children(server.pid)
    server.seen.add(pid)
    return pid


def served_again(server: Served, dead: int, timeout: float = 120) -> int:
    """The new API process's pid once it serves (/health 200 from a child that is not `dead`)."""

    def serving() -> bool:
        pids = children(server.pid)
        if not pids or pids == [dead]:
            return False
        try:
            return httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(serving, timeout, "the API server serving again")
    return api_pid(server)


def completes(server: Served) -> bool:
    reply = sdk(server).completions.create(model="tiny", prompt="x", max_tokens=4)
    return reply.choices[0].finish_reason in ("length", "stop")


# -- the red team's requests ---------------------------------------------------------------------


def test_the_red_teams_chains_are_400s_naming_the_limit_and_the_server_serves_on(
    model: Path,
) -> None:
    with served(model, *SUPERVISED) as server:
        api = api_pid(server)
        client = sdk(server)
        grammar = rule_chain(3000)
        schema = ref_chain(3000)
        assert 120_000 < len(json.dumps({"structured_outputs": {"grammar": grammar}})) < 256_000
        started = time.monotonic()
        with pytest.raises(openai.BadRequestError) as rules:
            client.completions.create(
                model="tiny",
                prompt="x",
                max_tokens=4,
                extra_body={"structured_outputs": {"grammar": grammar}},
            )
        with pytest.raises(openai.BadRequestError) as refs:
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "chain", "schema": schema},
                },
            )
        # 100,000 links, written short enough to pass the 4 MiB body limit (not a 413).
        bare = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(100_000))
        with pytest.raises(openai.BadRequestError) as huge:
            client.completions.create(
                model="tiny",
                prompt="x",
                max_tokens=4,
                extra_body={"structured_outputs": {"grammar": bare + 'r100000: "z"'}},
            )
        defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(100_000)}
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "chain", "schema": {"$ref": "#/$defs/d0", "$defs": defs}},
            },
        }
        compact = json.dumps(body, separators=(",", ":"))
        assert len(compact) < 4 << 20
        huge_refs = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            content=compact,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        with pytest.raises(openai.BadRequestError) as optionals:  # 5-7 s in llguidance's lexer
            client.completions.create(
                model="tiny",
                prompt="x",
                max_tokens=4,
                extra_body={"structured_outputs": {"regex": "a?" * 16_000}},
            )
        took = time.monotonic() - started
        assert isinstance(optionals.value.body, dict)
        assert optionals.value.body["message"] == (
            "the structured_outputs.regex has more than 1000 optional items (? or *) in one "
            "regex, the limit (--structured-outputs-max-regex-optionals); use a counted repeat "
            "such as a{0,N} instead"
        )
        assert rules.value.body == {
            "message": "the structured_outputs.grammar nests 3002 deep (rules on one chain of "
            "references, an inline %json adding its depth); the limit is 512 "
            "(--structured-outputs-max-depth)",
            "type": "invalid_request_error",
            "param": "structured_outputs.grammar",
            "code": None,
        }
        assert refs.value.body == {
            "message": "the structured_outputs.json nests 6003 deep (JSON objects on one path, "
            "each $ref followed); the limit is 512 (--structured-outputs-max-depth)",
            "type": "invalid_request_error",
            "param": "structured_outputs.json",
            "code": None,
        }
        assert isinstance(huge.value.body, dict)
        assert huge.value.body["message"] == (
            "the structured_outputs.grammar is 1477807 bytes; the limit is 262144 bytes "
            "(--structured-outputs-max-bytes)"
        )
        assert huge_refs.status_code == 400
        assert huge_refs.json()["error"]["message"] == (
            "the structured_outputs.json is 3777818 bytes; the limit is 262144 bytes "
            "(--structured-outputs-max-bytes)"
        )
        assert took < 30  # refused by measuring, not by compiling
        assert completes(server)
        assert api_pid(server) == api  # the same process: nothing crashed
        assert "the API server" not in server.output()


@pytest.mark.slow
def test_a_raised_budget_admits_3000_links_and_the_api_process_lives(model: Path) -> None:
    """`--structured-outputs-max-depth 100000`: the frontend's check (256 MiB stack) passes
    the 3,000 rules; the engine, compiling them again on an 8 MiB thread, dies twice (the
    request is then failed as poison, issue 16) and is restarted. The API process is the same
    one throughout, and serves the next request."""
    args = (*SUPERVISED, "--structured-outputs-max-depth", "100000", "--max-engine-restarts", "3")
    with served(model, *args) as server:
        api = api_pid(server)
        reply = httpx.post(
            f"{server.base_url}/v1/completions",
            json={
                "prompt": "x",
                "max_tokens": 4,
                "structured_outputs": {"grammar": rule_chain(3000)},
            },
            timeout=180,
        )
        assert reply.status_code in (200, 503), reply.text  # 503: the engine's poison verdict
        wait_for(lambda: completes(server), 120, "a completion after the engine's restarts")
        assert api_pid(server) == api
        assert "the API server" not in server.output()


# -- a crash planted in the API process ----------------------------------------------------------


def crash(server: Served, how: str) -> None:
    """POST /crash?how=...: no answer comes, the connection just closes."""
    with pytest.raises(httpx.TransportError):
        httpx.post(f"{server.base_url}/crash", params={"how": how}, timeout=60)


CAUSES = {
    "segfault": "was killed by signal 11 (SIGSEGV)",
    "kill": "was killed by signal 9 (SIGKILL)",
    "exception": "exited with status 70 (an uncaught exception; its traceback is above)",
}


def in_flight(server: Served) -> float:
    return scrape(server)["trillm:http_requests_in_flight"]  # type: ignore[arg-type]


@pytest.mark.slow
def test_planted_crashes_are_survived_logged_and_bounded(model: Path) -> None:
    with served(model, *CRASH_FLAGS) as server, ThreadPoolExecutor(1) as pool:
        pids = [api_pid(server)]
        for restart, how in enumerate(CAUSES, start=1):
            # A stream open at the crash: it ends with a connection error, never hangs.
            stream = sdk(server).completions.create(
                model="tiny",
                prompt="x",
                max_tokens=400,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            next(iter(stream))  # flowing
            retried = None
            if how == "segfault":  # and one without a stream, by a client that retries
                retried = pool.submit(
                    sdk(server, max_retries=2).completions.create,
                    model="tiny",
                    prompt="x",
                    max_tokens=300,
                    extra_body={"ignore_eos": True},
                )
                wait_for(lambda: in_flight(server) == 2, 60, "two requests in flight")
            crash(server, how)
            with pytest.raises((openai.APIConnectionError, httpx.TransportError)):
                for _ in stream:
                    pass
            # Sent while no child serves: it waits in the parent's socket, then is served.
            waited = httpx.get(f"{server.base_url}/health", timeout=120)
            assert waited.status_code == 200
            pids.append(served_again(server, pids[-1]))
            output = server.output()
            assert (f"trillm: the API server (pid {pids[-2]}) {CAUSES[how]} after ") in output, (
                output
            )
            assert (
                f"its open requests are lost (their connections closed); starting it again "
                f"(restart {restart}, at most 3 within 300 s: --max-api-restarts)"
            ) in output
            assert f"trillm: the API server serves again (pid {pids[-1]}, after " in output
            assert completes(server)
            if retried is not None:  # its retry waited for the new API server, then was served
                usage = retried.result(timeout=120).usage
                assert usage is not None and usage.completion_tokens == 300
        output = server.output()
        assert "Fatal Python error: Segmentation fault" in output  # faulthandler's stacks
        assert 'File "' in output.split("Fatal Python error: Segmentation fault", 1)[1]
        assert "RuntimeError: planted by POST /crash?how=exception" in output
        wait_dead(pids[:-1], 10)  # every dead child reaped, its engine gone with it
        assert shm_names_of(pids[:-1]) == []
        # A fourth crash within the window: past --max-api-restarts, the supervisor exits 1.
        crash(server, "segfault")
        assert server.wait_exit(30) == 1
        assert (
            f"trillm: the API server (pid {pids[-1]}) was killed by signal 11 (SIGSEGV) after"
        ) in server.output()
        assert (
            "; not restarting it: 3 restarts within 300 s already (--max-api-restarts, "
            "--api-restart-window)"
        ) in server.output()
        wait_dead(server.seen, 10)


@pytest.mark.slow
def test_without_the_supervisor_the_same_crash_ends_the_server(model: Path) -> None:
    """`--max-api-restarts 0`: the API server is the `trillm serve` process, as before."""
    with served(model, "--max-api-restarts", "0", "--enable-dev-endpoints") as server:
        assert len(server.tree()) == 2  # the API server and its engine, no parent above
        crash(server, "segfault")
        assert server.wait_exit(30) == -signal.SIGSEGV


# -- the supervisor's own life -------------------------------------------------------------------


def test_sigkill_of_the_supervisor_leaves_no_process(model: Path) -> None:
    with served(model, *SUPERVISED) as server:
        tree = server.tree()
        assert len(tree) == 3  # supervisor, API server, engine
        killed = time.monotonic()
        server.process.kill()
        server.process.wait()
        wait_dead(tree, 5)
        assert time.monotonic() - killed < 5
        assert shm_names_of(tree) == []


@pytest.mark.slow
def test_an_engine_death_past_its_restarts_ends_the_supervisor_with_status_1(model: Path) -> None:
    """Not an API crash: the API server exits on purpose (1, the cause on stderr), and so does
    the supervisor, without starting it again."""
    with served(model, *SUPERVISED, "--engine-death-grace", "0") as server:
        api = api_pid(server)
        (engine,) = children(api)
        os.kill(engine, signal.SIGKILL)
        assert server.wait_exit(60) == 1
        output = server.output()
        assert (
            "trillm serve: the engine died: engine process killed by signal 9 (SIGKILL)" in output
        )
        assert "starting it again" not in output and "the API server" not in output
        assert is_dead(api)


@pytest.mark.slow
def test_a_start_up_failure_is_reported_once_not_restarted(tmp_path: Path) -> None:
    with served(tmp_path / "no-such-model", *SUPERVISED, healthy=False) as server:
        assert server.wait_exit(120) == 1
        output = server.output()
        assert output.count("trillm serve: the engine failed to start") == 1, output
        assert "starting it again" not in output


# The supervisor's decisions, with a stand-in for the server: `serve` says it serves (or
# not), then does what the case asks. No model, no engine: seconds per case.
STAND_IN = """
import os, signal, sys
from trillm.gpu import WorkerConfig
from trillm.http.server._server import build_config
from trillm.cli._supervisor import supervise

config = build_config(
    host="127.0.0.1", port=0, served_model_name="x", worker=WorkerConfig("unused"),
    tensor_parallel_size=1, enable_prefix_caching=True, executor="null", api_key=None,
    max_queued_requests=1, shutdown_timeout=1,
)
plan = sys.argv[1]

def serve(config):
    if plan == "segfault-at-start":
        os.kill(os.getpid(), signal.SIGSEGV)
    os.write(config.ready_fd, b"serving\\n")
    if plan == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    if plan == "raise":
        raise RuntimeError("a bug")
    return int(plan)

sys.exit(supervise(config, serve, max_restarts=2, window=60))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("plan", "status", "restarts", "last"),
    [
        ("0", 0, 0, None),
        ("1", 1, 0, None),  # an exit on purpose: the status, no restart
        ("3", 1, 2, "exited with status 3 after"),
        ("segfault", 1, 2, "was killed by signal 11 (SIGSEGV) after"),
        ("raise", 1, 2, "exited with status 70 (an uncaught exception; its traceback is above)"),
        ("segfault-at-start", 1, 0, "was killed by signal 11 (SIGSEGV) after"),
    ],
)
def test_what_the_supervisor_restarts_and_what_it_exits_with(
    plan: str, status: int, restarts: int, last: str | None
) -> None:
    run = subprocess.run(
        [sys.executable, "-c", STAND_IN, plan], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == status, run.stderr
    assert run.stderr.count("starting it again (restart ") == restarts, run.stderr
    if last is None:
        assert "trillm: the API server" not in run.stderr
    elif plan == "segfault-at-start":
        assert f"{last}" in run.stderr and "before it served; not restarting it" in run.stderr
    else:
        assert run.stderr.count(last) == 3, run.stderr  # the first run and both restarts
        assert "not restarting it: 2 restarts within 60 s already" in run.stderr
    if plan == "raise":
        assert run.stderr.count("RuntimeError: a bug") == 3


@pytest.mark.slow
def test_a_taken_port_is_refused_before_any_child(model: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            serve_command(model, port, *SUPERVISED), capture_output=True, text=True, timeout=120
        )
    assert run.returncode == 1
    assert run.stderr.endswith(
        f"trillm serve: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    ), run.stderr
