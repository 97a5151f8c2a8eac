"""perf/_launch_count.py (`gpu_bench.py --count-launches`): views and allocations launch
nothing, every other aten op and each Triton launch count one, and a decode step's count is its
layers' and the rest's, the same every step."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

PERF = Path(__file__).resolve().parents[2] / "perf"
sys.path.insert(0, str(PERF))  # perf/ is scripts, not a package

from _launch_count import LaunchCounter  # noqa: E402
from gpu_bench import TINY, count_launches  # noqa: E402


def test_views_and_allocations_launch_nothing() -> None:
    x = torch.randn(4, 6)
    with LaunchCounter() as counter:
        y = x.view(6, 4).t().unsqueeze(0)[..., :2]  # views only
        z = torch.empty(3)
        w = (x + 1).sum()  # two kernels
        w.item()  # a sync, not a launch
    assert y.shape == (1, 4, 2) and z.shape == (3,)
    assert counter.by_region == {"rest": 2}
    assert counter.rest_ops == {"aten.add": 1, "aten.sum": 1}
    assert counter.syncs == 1


def test_a_decode_step_is_its_layers_and_the_rest(tmp_path: Path) -> None:
    args = argparse.Namespace(dry_run=True, attention_backend="auto", context=32, steps=2)
    result = count_launches(args, torch.device("cpu"), tmp_path)
    assert result["attention_backend"] == "triton"  # CUDA's, in its interpreter here
    (model,) = result["launches"]
    (step,) = model["eager"]
    assert model["layers"] == TINY["num_hidden_layers"] and step["batch"] == 1
    assert step["same_every_step"] and step["steps_counted"] == 4
    assert step["per_step"] == step["per_layer"] * model["layers"] + step["outside_layers"]
    assert step["layer_ops"]["triton._attention_kernel"] == 1
    assert step["layer_ops"]["triton._write_kv_kernel"] == 1
    assert sum(step["layer_ops"].values()) == step["per_layer"]
    assert sum(step["outside_ops"].values()) == step["outside_layers"]
    assert step["outside_ops"]["aten.embedding"] == 1
    assert step["cuda_profiler"] is None  # CPU
    # the fused kernels (CUDA's eager path, interpreted here): at most 10 a layer
    (fused,) = model["fused"]
    assert fused["same_every_step"] and fused["per_layer"] <= 10
    assert fused["layer_ops"]["triton._rms_norm_kernel"] == 2
    assert fused["layer_ops"]["triton._rope_write_kv_kernel"] == 1
    assert fused["layer_ops"]["triton._silu_mul_kernel"] == 1
    assert "triton._write_kv_kernel" not in fused["layer_ops"]  # rotary writes the cache
    assert fused["per_step"] == fused["per_layer"] * model["layers"] + fused["outside_layers"]
    # a mixed step (decodes beside a prompt, eager on CUDA): the same kernels a layer
    for mode, step in (("eager", model["eager"][0]), ("fused", fused)):
        mixed = model[f"{mode}_mixed"]
        assert mixed["prompt"] == 16 and mixed["per_layer"] == step["per_layer"]
