"""Builds trillm's C kernels (`csrc/*.c`) with the system's C compiler, once, and loads them.

Why C and not a torch extension: the kernels need no torch headers (they take raw pointers,
through ctypes), so a build is one `cc` call of about a second instead of the minute
`torch.utils.cpp_extension` spends on a 2-core machine, and there is no Python ABI to match.

Why at run time: the build uses `-march=native`, so the code is this CPU's (AVX-512 where it
has it, AVX2 or SSE where not); a prebuilt binary would have to pick the lowest.
`$TRILLM_CPU_MARCH` (e.g. `x86-64-v3`: AVX2) builds for another level instead, so the AVX2 and
SSE code is tested on an AVX-512 machine too. The shared
object is cached under `$TRILLM_CACHE_DIR` (default `~/.cache/trillm`), keyed by the source,
the compiler's version, the flags and this CPU's feature flags, and written atomically (build
into a temporary name, then rename), so concurrent processes never load half a file.

OpenMP: the object links `libgomp.so.1`, and in a process that has imported torch the dynamic
linker resolves that to the libgomp torch already loaded (one soname, one copy), so the
kernels' threads are torch's threads, not a second pool fighting it for the cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401 - loaded first, so the kernels share torch's libgomp

CSRC = Path(__file__).resolve().parent / "csrc"
FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-Wno-psabi")
BUILD_TIMEOUT_S = 120


class NativeBuildError(RuntimeError):
    """The C kernels could not be built here (no compiler, or it failed); says which."""


def cache_dir() -> Path:
    root = os.environ.get("TRILLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "trillm"
    )
    return Path(root) / "kernels"


# The kernels this process compiled (the rest came from the cache): the start-up log's words.
BUILT: list[str] = []


class NativeLibrary(ctypes.CDLL):
    """A loaded build of the C kernels and the file it came from, whose name carries its
    build key (`key`): what anything measured of these kernels must be keyed by, since the
    sources may change (and rebuild) while a process runs the object it loaded."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.path = path

    @property
    def key(self) -> str:
        """ "cpu_decode-<16 hex digits>": the source, compiler, flags and CPU flags' hash."""
        return self.path.stem


@functools.cache
def load(name: str) -> NativeLibrary:
    """The built `csrc/<name>.c`, loaded (built first if this machine has no cached copy).

    Raises:
        NativeBuildError: no C compiler (`$CC`, else `cc`), or the build failed; the message
            carries the compiler's own error.
    """
    source = CSRC / f"{name}.c"
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise NativeBuildError(
            f"no C compiler {compiler!r} on PATH to build {source.name}; install gcc (or set "
            f"CC), or run with --enforce-eager"
        )
    flags = (*FLAGS, f"-march={os.environ.get('TRILLM_CPU_MARCH') or 'native'}")
    key = hashlib.sha256()
    for part in [*sorted(CSRC.glob("*.h")), source]:  # the headers it includes, and itself
        key.update(part.read_bytes())
    key.update(_compiler_version(compiler).encode())
    key.update(" ".join(flags).encode())
    key.update(_cpu_flags().encode())
    target = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        _build(compiler, flags, source, target)
        BUILT.append(name)
    return NativeLibrary(target)


def _build(compiler: str, flags: tuple[str, ...], source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, "-o", tmp, str(source), "-lm"],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise NativeBuildError(
                f"{compiler} could not build {source.name} (exit {done.returncode}): "
                f"{done.stderr.strip()[-2000:]}"
            )
        os.replace(tmp, target)
    except subprocess.TimeoutExpired as e:
        raise NativeBuildError(f"{compiler} took over {BUILD_TIMEOUT_S} s on {source.name}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _compiler_version(compiler: str) -> str:
    done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    return done.stdout


def cpu_identity() -> str:
    """This CPU's model name and feature flags (/proc/cpuinfo's lines): what a timing taken
    on it holds for."""
    return _cpuinfo_line(("model name", "Processor")) + _cpu_flags()


def _cpu_flags() -> str:
    """This CPU's feature flags (what -march=native compiles for), from /proc/cpuinfo."""
    return _cpuinfo_line(("flags", "Features"))


def _cpuinfo_line(prefixes: tuple[str, ...]) -> str:
    """The first line of /proc/cpuinfo that starts with one of `prefixes` ("" off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(prefixes):
                    return line
    except OSError:
        pass
    return ""
