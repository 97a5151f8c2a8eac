"""`_lora_files`: an adapter's two files read bounded and checked, and its checked copy, the
bytes every later read takes (only with the digest they had)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trillm.gpu.lora._lora_files import (
    AdapterFiles,
    LoraAdapterError,
    keep_checked_copy,
    read_adapter_files,
    read_checked_files,
)

CAP = 1 << 16


def adapter(path: Path, config: bytes = b"{}", weights: bytes = b"w" * 100) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_bytes(config)
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


def test_two_regular_files_are_read_whole(tmp_path: Path) -> None:
    files = read_adapter_files("a", str(adapter(tmp_path / "a")), max_weights_bytes=CAP)
    assert files == AdapterFiles(b"{}", b"w" * 100)


def test_links_to_regular_files_are_followed_as_in_a_hub_cache(tmp_path: Path) -> None:
    """A hub snapshot is a directory of links to blobs: the targets are what is read."""
    blobs = adapter(tmp_path / "blobs", weights=b"blob")
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (snapshot / name).symlink_to(blobs / name)
    files = read_adapter_files("a", str(snapshot), max_weights_bytes=CAP)
    assert files.weights == b"blob"


def test_a_file_over_its_cap_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = adapter(tmp_path / "a", weights=b"w" * (CAP + 1))
    with pytest.raises(LoraAdapterError, match=f"has {CAP + 1} bytes, over the {CAP}"):
        read_adapter_files("a", str(path), max_weights_bytes=CAP)


@pytest.mark.parametrize("target", ["/dev/null", "/proc/self/environ", "/sys/kernel/notes"])
def test_nothing_under_dev_proc_or_sys_is_opened(tmp_path: Path, target: str) -> None:
    path = adapter(tmp_path / "a")
    (path / "adapter_config.json").unlink()
    (path / "adapter_config.json").symlink_to(target)
    with pytest.raises(LoraAdapterError, match="'a': no adapter this server can read"):
        read_adapter_files("a", str(path), max_weights_bytes=CAP)


def test_a_directory_in_place_of_a_file_is_refused(tmp_path: Path) -> None:
    path = adapter(tmp_path / "a")
    (path / "adapter_model.safetensors").unlink()
    (path / "adapter_model.safetensors").mkdir()
    with pytest.raises(LoraAdapterError, match="no adapter this server can read"):
        read_adapter_files("a", str(path), max_weights_bytes=CAP)


def test_the_checked_copy_is_read_instead_of_the_path(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    files = read_adapter_files("a", str(adapter(tmp_path / "a")), max_weights_bytes=CAP)
    keep_checked_copy("a", str(cache), files)
    assert sorted(os.listdir(cache)) == [files.digest]  # no half-written part left
    assert (cache.stat().st_mode & 0o777) == 0o700
    (tmp_path / "a").rename(tmp_path / "moved")
    got = read_checked_files("a", str(tmp_path / "a"), files.digest, str(cache),
                             max_weights_bytes=CAP)  # fmt: skip
    assert got == files
    keep_checked_copy("a", str(cache), files)  # there already: kept as it is


def test_other_bytes_under_a_known_digest_are_refused(tmp_path: Path) -> None:
    path = adapter(tmp_path / "a")
    digest = read_adapter_files("a", str(path), max_weights_bytes=CAP).digest
    (path / "adapter_model.safetensors").write_bytes(b"other weights")
    with pytest.raises(LoraAdapterError, match="changed since it was loaded"):
        read_checked_files("a", str(path), digest, "", max_weights_bytes=CAP)
    with pytest.raises(LoraAdapterError, match="changed since it was loaded"):  # a bad copy too
        bad = tmp_path / "cache" / digest
        adapter(bad, weights=b"tampered")
        read_checked_files("a", str(path), digest, str(tmp_path / "cache"), max_weights_bytes=CAP)
