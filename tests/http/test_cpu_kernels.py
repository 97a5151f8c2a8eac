"""`trillm serve --dtype bfloat16` on a CPU whose oneDNN cannot run bfloat16, for real.

oneDNN and ATen read a cap on the ISA they use (`ONEDNN_MAX_CPU_ISA`, `ATEN_CPU_CAPABILITY`),
so an AVX-512 machine can be made to act as an AVX2-only one: under these two variables
`torch.ops.mkldnn._reorder_linear_weight` raises for bfloat16 exactly as on such a CPU, which
stopped the server at model load before the probe existed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai

from trillm.gpu.cpu._cpu_linear import BF16_WITHOUT_HARDWARE
from trillm.gpu.cpu._tiles import pair_products, pairs_ready, tiled_kernels

from .conftest import start_server

AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def test_the_cap_reproduces_an_avx2_only_cpu() -> None:
    """The premise: under the cap, oneDNN refuses to pack bfloat16 (and still packs float32)."""
    probe = (
        "import torch\n"
        "from trillm.gpu.cpu._cpu_linear import pack_weight\n"
        "pack_weight(torch.ones(16, 16))\n"
        "pack_weight(torch.ones(16, 16, dtype=torch.bfloat16))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, **AVX2_ONLY},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0 and "bf16 path needs the cpu support" in run.stderr


def test_bfloat16_serves_on_plain_linears_and_says_so(tiny_model: Path, tmp_path: Path) -> None:
    with open(tmp_path / "stderr", "wb") as stderr:
        server = start_server(  # --cpu-decode c: the C step's word below, on any machine
            tiny_model, "--dtype", "bfloat16", "--cpu-decode", "c", env=AVX2_ONLY, stderr=stderr
        )
        try:
            sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
            reply = sdk.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "Hello?"}],
                max_tokens=6,
                extra_body={"ignore_eos": True},
            )
            assert reply.usage is not None and reply.usage.completion_tokens == 6
            assert reply.choices[0].finish_reason == "length"
            kernels = httpx.get(f"{server.base_url}/version").json()["kernels"]
            metrics = httpx.get(f"{server.base_url}/metrics").text
        finally:
            assert server.stop() == 0
    reason = (
        "oneDNN cannot pack bfloat16 on this CPU "
        "(it needs avx512bw, avx512vl and avx512dq, or avx_ne_convert)" + BF16_WITHOUT_HARDWARE
    )
    assert kernels["device"] == "cpu" and kernels["dtype"] == "bfloat16"
    assert kernels["linear"] == "aten" and kernels["reason"] == reason
    assert kernels["isa"].startswith("AVX2 ") and kernels["isa"].endswith(" onednn:float32")
    info = [line for line in metrics.splitlines() if line.startswith("trillm:kernel_info{")]
    assert len(info) == 1 and 'linear="aten"' in info[0] and 'dtype="bfloat16"' in info[0]
    logged = [
        line
        for line in (tmp_path / "stderr").read_text().splitlines()
        if line.startswith("trillm: kernels: ")
    ]
    assert len(logged) == 1 and logged[0].startswith(
        f"trillm: kernels: bfloat16 on cpu, linears aten ({kernels['isa']}; {reason}), "
        "attention torch, decode "
    )
    # The cap reaches oneDNN and ATen, not the C kernels built for this CPU: AMX tiles where
    # their products run here (`pairs_ready`), which a real AVX2-only CPU has not.
    pairs = tiled_kernels() is not None and pairs_ready()
    layers = f"bfloat16 AMX ({pair_products()}) layers" if pairs else "bfloat16 layers"
    assert (f", decode c (one call per step of up to 64 decodes; {layers}" in logged[0]) == (
        tiled_kernels() is not None
    )
