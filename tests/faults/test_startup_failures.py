"""Case 7: start-up failures exit non-zero with the cause and never report ready.

A missing model, a corrupt (truncated) safetensors file, and a KV cache that does not fit.
The three start concurrently: each is a few seconds of fresh interpreters importing torch,
and they do not interact. (A KV cache too small for one request of the maximum length is
refused the same way, by the scheduler's config: tests/engine/core.)
"""

from __future__ import annotations

import shutil
import socket
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from .figures import record
from .http_harness import tiny_model_dir
from .proc_harness import served, shm_names_of, wait_dead


@dataclass
class Failure:
    code: int
    output: str
    seconds: float
    listened: bool  # its port took a connection at some point: it was serving


def start_and_fail(model: Path | str, *args: str) -> Failure:
    """Start `trillm serve`, trying its port until it exits (bounded); what it did.

    A bare connect, not an HTTP client: four of these poll at once on two cores.
    """
    listened = False
    with served(model, *args, healthy=False) as server:
        started = time.monotonic()
        while server.process.poll() is None:
            assert time.monotonic() - started < 120, f"still running:\n{server.output()}"
            with suppress(OSError), socket.create_connection(("127.0.0.1", server.port), 0.5):
                listened = True
            time.sleep(0.05)
        seconds = time.monotonic() - started
        wait_dead(server.seen, 5)
        assert shm_names_of(server.seen) == []
        return Failure(server.process.returncode, server.output(), seconds, listened)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


@pytest.mark.slow
async def test_start_up_failures_exit_non_zero_naming_the_cause(
    model: Path, tmp_path: Path
) -> None:
    corrupt = tmp_path / "corrupt"
    shutil.copytree(model, corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
    cases = {
        "missing model": (
            (tmp_path / "missing",),
            "engine raised ModelConfigError: model '{model}' does not exist: give a",
        ),
        "corrupt safetensors": (
            (corrupt,),
            "engine raised WeightsError: cannot read {model}/model.safetensors: Error while "
            "deserializing header: incomplete metadata, file not fully covered (a corrupt or "
            "truncated file?)",
        ),
        "KV cache that does not fit": (
            (model, "--kv-cache-memory-bytes", "1000"),
            "engine raised KVCacheTooSmallError: the KV cache does not fit: one block of 16 "
            "tokens needs 8192 bytes on rank 0 and the budget is 1000 bytes; raise "
            "kv_cache_bytes (--kv-cache-memory-bytes, CPU)",
        ),
    }
    results: dict[str, Failure] = {}

    async def run(name: str, args: tuple[Path | str, ...]) -> None:
        results[name] = await trio.to_thread.run_sync(lambda: start_and_fail(*map(str, args)))

    async with trio.open_nursery() as nursery:
        for name, (args, _) in cases.items():
            nursery.start_soon(run, name, args)
    for name, (args, cause) in cases.items():
        failure = results[name]
        record(7, f"{name}: exited (status {failure.code}) after", failure.seconds, "s")
        expected = "trillm serve: the engine failed to start: " + cause.format(model=args[0])
        assert expected in failure.output, failure.output
        assert failure.code == 1
        assert not failure.listened
        assert "trillm: serving" not in failure.output
