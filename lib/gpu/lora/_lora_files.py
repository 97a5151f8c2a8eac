"""Reading a LoRA adapter's two files safely: bounded, regular files only, never blocking.

A runtime load names a server path a client chose (`lora_path`), so what the filesystem
hands back is bounded here before anything parses it:

- a path over `MAX_PATH_CHARS` is refused before any system call (a 5,000-character path
  made `Path.is_dir()` raise `OSError`, file name too long);
- each file's path is resolved once (`realpath`: an adapter in a hub cache is a directory of
  links) and the target opened with `O_NOFOLLOW | O_NONBLOCK`, so the file checked is the
  file read; `fstat` must show a regular file (a FIFO froze the engine's loop, `/dev/zero`
  grew it 2.4 GiB), and nothing under `/proc`, `/sys` or `/dev` is opened (`/proc/self/mem`
  is a "regular" file whose read fails);
- sizes are capped before reading: the config at `MAX_CONFIG_BYTES`, the weights at what the
  caller allows (`--max-lora-rank` and the model's shapes), and exactly `st_size` bytes are
  read (a file that grows or shrinks meanwhile is refused).

Every way a path can fail to be an adapter (no such directory, not a directory, no
permission, a missing, special or unreadable file) is one message, which says nothing of
what exists on the server; the operator's stderr gets the precise cause.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass

MAX_PATH_CHARS = 4096  # PATH_MAX
MAX_CONFIG_BYTES = 1 << 20
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_SPECIAL = ("/proc/", "/sys/", "/dev/")
_CHUNK = 1 << 24


class LoraAdapterError(ValueError):
    """An adapter that cannot be served; the message names it and what to change."""


class _Unreadable(Exception):
    """A file that is not there or not one to read (the precise cause, for stderr)."""


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter's checked bytes: its config and its weights, as read once."""

    config: bytes
    weights: bytes

    @property
    def digest(self) -> str:
        """sha256 of the config and the weights: the adapter's identity (prefix cache)."""
        return hashlib.sha256(self.config + self.weights).hexdigest()


def read_adapter_files(name: str, path: str, *, max_weights_bytes: int) -> AdapterFiles:
    """The two files of the PEFT adapter directory `path`, bounded and checked.

    Raises:
        LoraAdapterError: `path` holds no adapter this server can read, or a file is over
            its cap (the message names adapter `name`).
    """
    if len(path) > MAX_PATH_CHARS:
        raise LoraAdapterError(
            f"LoRA adapter {name!r}: its path has {len(path)} characters, over {MAX_PATH_CHARS}"
        )
    try:
        config = _read_regular(os.path.join(path, CONFIG_FILE), MAX_CONFIG_BYTES, name)
        weights = _read_regular(os.path.join(path, WEIGHTS_FILE), max_weights_bytes, name)
    except LoraAdapterError:
        raise
    except (_Unreadable, OSError, ValueError) as exc:  # ValueError: a NUL in the path
        print(f"trillm: LoRA adapter {name!r} at {path!r}: {exc}", file=sys.stderr, flush=True)
        raise LoraAdapterError(
            f"LoRA adapter {name!r}: no adapter this server can read at {path!r}: a PEFT "
            f"adapter is a directory with {CONFIG_FILE} and {WEIGHTS_FILE}, both regular "
            f"files (a pickled adapter_model.bin is never loaded: save it with "
            f"safe_serialization=True)"
        ) from None
    return AdapterFiles(config, weights)


def read_checked_files(
    name: str, path: str, digest: str, cache_dir: str, *, max_weights_bytes: int
) -> AdapterFiles:
    """An adapter's bytes: from its checked copy in `cache_dir` when there is one, else from
    `path`; where its `digest` is known already (a reload, a restarted engine), the bytes
    must have it, so weights swapped in after the checks are never served under it.

    Raises:
        LoraAdapterError: as `read_adapter_files`, or the files changed since they were
            checked.
    """
    if digest and cache_dir:
        copy = os.path.join(cache_dir, digest)
        if os.path.isdir(copy):
            with_copy = read_adapter_files(name, copy, max_weights_bytes=max_weights_bytes)
            if with_copy.digest == digest:
                return with_copy
    files = read_adapter_files(name, path, max_weights_bytes=max_weights_bytes)
    if digest and files.digest != digest:
        raise LoraAdapterError(
            f"LoRA adapter {name!r}: its files at {path!r} changed since it was loaded "
            f"(their sha256 differs): load the new weights under a new name"
        )
    return files


def keep_checked_copy(name: str, cache_dir: str, files: AdapterFiles) -> None:
    """Keep `files` (checked) as `cache_dir/<digest>/`, which later reads take instead of the
    user's path; written in a temporary directory and renamed, so a reader never sees half.

    Raises:
        LoraAdapterError: the copy cannot be written (a full disk, no permission).
    """
    target = os.path.join(cache_dir, files.digest)
    if os.path.isdir(target):
        return
    try:
        os.makedirs(cache_dir, mode=0o700, exist_ok=True)
        part = tempfile.mkdtemp(prefix=".part-", dir=cache_dir)
        try:
            for file, data in ((CONFIG_FILE, files.config), (WEIGHTS_FILE, files.weights)):
                with open(os.path.join(part, file), "wb") as f:
                    f.write(data)
            os.rename(part, target)
        except OSError:
            shutil.rmtree(part, ignore_errors=True)
            if not os.path.isdir(target):  # another rank's rename won: the same bytes
                raise
    except OSError as exc:
        raise LoraAdapterError(
            f"LoRA adapter {name!r}: cannot keep its checked copy in {cache_dir!r}: {exc}"
        ) from None


def _read_regular(path: str, limit: int, name: str) -> bytes:
    """All of the regular file `path`, at most `limit` bytes (`LoraAdapterError` past it)."""
    real = os.path.realpath(path)
    if real.startswith(_SPECIAL):
        raise _Unreadable(f"{path!r} resolves to {real!r}, under {', '.join(_SPECIAL)}")
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _Unreadable(f"{real!r} is not a regular file (mode {info.st_mode:o})")
        if info.st_size > limit:
            raise LoraAdapterError(
                f"LoRA adapter {name!r}: {os.path.basename(path)} has {info.st_size} bytes, "
                f"over the {limit} this server takes (the weights' cap follows "
                f"--max-lora-rank and the model's shapes)"
            )
        return _read_exactly(fd, info.st_size, real)
    finally:
        os.close(fd)


def _read_exactly(fd: int, size: int, path: str) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, min(_CHUNK, size - len(data)))
        if not chunk:
            raise _Unreadable(f"{path!r} shrank while read ({len(data)} of {size} bytes)")
        data += chunk
    if os.read(fd, 1):
        raise _Unreadable(f"{path!r} grew while read (past {size} bytes)")
    return bytes(data)
