"""Where one prefill's time goes: linears, attention, the rest, against the compute floor.

Runs a P-token prompt through trillm's model runner (the built-in SmolLM2-135M, float32, CPU)
`--repeats` times, then once more per repeat under the torch profiler, and groups the
profiler's self time: oneDNN/MKL linears, attention (SDPA), everything else. The floor is the
prompt's FLOPs over the machine's best fp32 matmul rate, as `compare.py` computes it.

    python perf/prefill_profile.py [--prompt-len 128] [--prompts 1] [--repeats 7] [--torch-silu]
        [--torch-attention] [--torch-norm | --ab-norm | --ab-elementwise | --ab-attention-io
        | --ab-base REV [--mixed B]]
        [--dtype bfloat16] [--threads N] [--cpu-time] [--glibc-default-malloc] [--no-profile]
        [--top N]

`--prompts N` prefills N prompts in one step (16 x 128 is a full 2048-token step);
`--torch-silu` runs torch's SiLU(gate) * up instead of the C one-pass kernel
(`lib/gpu/cpu/_cpu_ops.py`), to measure what that kernel saves; `--torch-attention` runs torch's
SDPA per prompt instead of the C attention (`trillm_attention`, a ctypes call the profiler
does not see: its time is in no group). `--torch-norm` runs torch's residual adds and
RMSNorms instead of the C one-pass ones (`_cpu_ops.CpuNorms`), and `--ab-norm` alternates the
two step by step in this process and prints both medians and their ratio (`--ab-elementwise`:
the norms and SiLU * up together, the C pair against torch's ops; with `--dtype bfloat16` the
bfloat16 kernels); `--ab-attention-io` alternates the C attention taking the bfloat16
forward's qkv and giving its output as they are against converting them to float32 and back
(`CAttention.native_bf16`). `--ab-base REV` alternates this tree against git revision REV's
C attention, norms and SiLU * up (built by `prompt_attention_bench.build_base`; the linears
and the head stay this tree's), REV's side converting the attention's bfloat16 IO as before
`io_type`: a before/after of the step's non-linear kernels in one process; with `--mixed B`
its steps are mixed steps instead: B sequences of `--prompt-len` tokens decode while a new
prompt as long arrives every other step (`_step_split.decode_and_mixed`; the C decode steps
between stay this tree's), the median mixed step of each run compared. `--threads N`
sets torch's threads; `--cpu-time` times the A/B steps by the process's CPU time (with one
thread, a busy machine's other work then counts less);
`--glibc-default-malloc` leaves glibc's mmap and trim thresholds as they are (the worker
raises them: `_worker.keep_activations_in_heap`). `--top N` lists the N torch ops of most self
time; `--no-profile` times the steps only. Besides the median it prints the first step (the
warm-up, which faults its memory in) and every step, and the minor page faults of the first
step and of the others (a count the machine's load does not move, unlike the times).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from compare import matmul_rates, prompt_gflops
from model_bench import prompts, trillm_run
from torch.profiler import profile

from trillm.default_model import default_model_dir
from trillm.gpu import Worker, WorkerConfig
from trillm.gpu.cpu._cpu_decode import CAttention

LINEAR = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm")
ATTENTION = ("attention", "sdpa")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--prompts", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--torch-silu", action="store_true")
    p.add_argument(
        "--torch-attention", action="store_true",
        help="torch's SDPA per prompt (as --enforce-eager), not the C attention",
    )  # fmt: skip
    p.add_argument("--torch-norm", action="store_true", help="torch's residual adds and norms")
    p.add_argument(
        "--ab-norm", action="store_true",
        help="alternate C and torch norms run by run; print both medians and the ratio",
    )  # fmt: skip
    p.add_argument(
        "--ab-elementwise", action="store_true",
        help="alternate C and torch norms *and* SiLU * up run by run (bfloat16 too)",
    )  # fmt: skip
    p.add_argument(
        "--ab-attention-io", action="store_true",
        help="alternate bfloat16 qkv/output to the C attention as they are and converted",
    )  # fmt: skip
    p.add_argument(
        "--ab-base", metavar="REV",
        help="alternate this tree's attention and element-wise kernels against REV's build",
    )  # fmt: skip
    p.add_argument("--mixed", type=int, default=0, help="--ab-base: B decodes + a prompt")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    p.add_argument("--threads", type=int, default=0, help="torch's threads (0: as is)")
    p.add_argument("--cpu-time", action="store_true", help="A/B steps by process CPU time")
    p.add_argument("--glibc-default-malloc", action="store_true", help="leave malloc's thresholds")
    p.add_argument("--no-profile", action="store_true", help="time the steps only")
    p.add_argument("--top", type=int, default=0, help="also print the N ops of most self time")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.torch_silu:
        import torch.nn.functional as F

        from trillm.gpu.cpu import _cpu_ops

        def torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up

        _cpu_ops.silu_mul = torch_silu_mul
    if args.torch_norm:
        from trillm.gpu.layers import _layers
        from trillm.gpu.models import llama

        llama.cpu_norms = _layers.cpu_norms = lambda x: None
    if args.glibc_default_malloc:
        from trillm.gpu.worker import _worker

        _worker.keep_activations_in_heap = lambda: False
    model = default_model_dir()
    worker = Worker(
        WorkerConfig(
            str(model),
            device="cpu",
            dtype=args.dtype,
            max_num_seqs=max(8, args.prompts, args.mixed + 1),
            enforce_eager=args.torch_attention,
        )
    )
    worker.init_device()
    worker.load_model()
    worker.init_kv_cache(worker.num_available_kv_blocks())
    vocab = worker.runner.model_config.vocab_size
    batch = prompts(args.prompts, args.prompt_len, vocab)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    first = trillm_run(worker, batch, 1)[0] * 1e3  # warm-up
    first_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    clock = time.process_time if args.cpu_time else time.perf_counter
    if args.ab_norm or args.ab_elementwise:
        ab_norm(worker, batch, args.repeats, clock, silu=args.ab_elementwise)
        return
    if args.ab_attention_io:
        ab_attention_io(worker, batch, args.repeats, clock)
        return
    if args.ab_base:
        ab_base(worker, batch, args.repeats, clock, args.ab_base, args.mixed)
        return
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = [trillm_run(worker, batch, 1)[0] * 1e3 for _ in range(args.repeats)]
    step_faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / args.repeats
    faulted = f"page faults: first step {first_faults}, then {step_faults:.0f} a step"
    if args.no_profile:
        print(f"{args.prompts} x {args.prompt_len}-token prefill, {args.repeats} runs: median "
              f"{statistics.median(times):.1f} ms, best {min(times):.1f} ms")  # fmt: skip
        print(f"first step {first:.1f} ms; steps " + " ".join(f"{t:.1f}" for t in times))
        print(faulted)
        return
    with profile() as prof:
        for _ in range(args.repeats):
            trillm_run(worker, batch, 1)
    groups = {"linears": 0.0, "attention": 0.0, "other": 0.0}
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3 / args.repeats
        if event.key in LINEAR:
            groups["linears"] += ms
        elif any(word in event.key for word in ATTENTION):
            groups["attention"] += ms
        else:
            groups["other"] += ms
    config = json.loads((Path(model) / "config.json").read_text())
    rate = max(matmul_rates(torch.get_num_threads()).values())
    floor = args.prompts * prompt_gflops(config, args.prompt_len) / rate * 1e3
    print(f"{args.prompts} x {args.prompt_len}-token prefill, {args.repeats} runs: median "
          f"{statistics.median(times):.1f} ms, best {min(times):.1f} ms; "
          f"floor {floor:.1f} ms at {rate:.0f} GFLOP/s")  # fmt: skip
    print(f"first step {first:.1f} ms; steps " + " ".join(f"{t:.1f}" for t in times))
    print(faulted)
    print("profiled (self CPU time per prefill, the profiler adds its own): " + ", ".join(
        f"{name} {ms:.1f} ms" for name, ms in groups.items()
    ))  # fmt: skip
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    for event in events[: args.top]:
        calls, ms = event.count / args.repeats, event.self_cpu_time_total / 1e3 / args.repeats
        print(f"    {event.key:<48} {calls:8.1f} calls {ms:9.2f} ms")


def step_ms(worker: Worker, batch: list[list[int]], clock: Callable[[], float]) -> float:
    """One prefill step of `batch` in ms: the step's own wall time, or with another `clock`
    the whole run's (the driver's few requests too)."""
    if clock is time.perf_counter:
        return trillm_run(worker, batch, 1)[0] * 1e3
    t0 = clock()
    trillm_run(worker, batch, 1)
    return (clock() - t0) * 1e3


def ab_norm(
    worker: Worker,
    batch: list[list[int]],
    repeats: int,
    clock: Callable[[], float],
    *,
    silu: bool = False,
) -> None:
    """Steps with the C norms and with torch's, alternated (the order flipped every pair);
    with `silu`, the C SiLU * up against torch's two ops as well."""
    import torch.nn.functional as F

    from trillm.gpu.cpu import _cpu_ops
    from trillm.gpu.layers import _layers
    from trillm.gpu.models import llama

    def torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    c_silu = _cpu_ops.silu_mul
    sides: dict[str, list[float]] = {"C": [], "torch": []}
    for r in range(repeats):
        for side in ("C", "torch") if r % 2 == 0 else ("torch", "C"):
            chosen = _cpu_ops.cpu_norms if side == "C" else (lambda x: None)
            llama.cpu_norms = _layers.cpu_norms = chosen  # type: ignore[assignment]
            if silu:
                _cpu_ops.silu_mul = c_silu if side == "C" else torch_silu_mul
            sides[side].append(step_ms(worker, batch, clock))
    c, t = statistics.median(sides["C"]), statistics.median(sides["torch"])
    pairs = statistics.median(x / y for x, y in zip(sides["C"], sides["torch"], strict=True))
    print(f"{repeats} pairs: C norms median {c:.1f} ms, torch norms {t:.1f} ms, C / torch "
          f"{c / t:.3f} (median of the pairs' ratios {pairs:.3f}); C "
          + " ".join(f"{x:.0f}" for x in sides["C"])
          + "; torch " + " ".join(f"{x:.0f}" for x in sides["torch"]))  # fmt: skip


def ab_attention_io(
    worker: Worker, batch: list[list[int]], repeats: int, clock: Callable[[], float]
) -> None:
    """Steps whose C attention takes the bfloat16 qkv as it is and steps that convert it to
    float32 and the output back, alternated (the order flipped every pair)."""
    sides: dict[str, list[float]] = {"native": [], "converted": []}
    try:
        for r in range(repeats):
            for side in ("native", "converted") if r % 2 == 0 else ("converted", "native"):
                CAttention.native_bf16 = side == "native"
                sides[side].append(step_ms(worker, batch, clock))
    finally:
        CAttention.native_bf16 = True
    n, c = statistics.median(sides["native"]), statistics.median(sides["converted"])
    pairs = statistics.median(
        x / y for x, y in zip(sides["native"], sides["converted"], strict=True)
    )
    print(f"{repeats} pairs: native median {n:.1f} ms, converted {c:.1f} ms, native / converted "
          f"{n / c:.3f} (median of the pairs' ratios {pairs:.3f}); native "
          + " ".join(f"{x:.0f}" for x in sides["native"])
          + "; converted " + " ".join(f"{x:.0f}" for x in sides["converted"]))  # fmt: skip


def ab_base(
    worker: Worker,
    batch: list[list[int]],
    repeats: int,
    clock: Callable[[], float],
    rev: str,
    mixed: int,
) -> None:
    """Steps with this tree's C attention, norms and SiLU * up, and steps with `rev`'s (its
    attention given float32 IO, as before `io_type`), alternated (the order flipped every
    pair); with `mixed`, runs of mixed steps. Only the attention's calls and the element-wise
    kernels take `rev`'s build: the C decode step and the tiled head read this tree's tiles."""
    from _step_split import decode_and_mixed
    from prompt_attention_bench import build_base

    from trillm.gpu import SamplingOptions
    from trillm.gpu.cpu import _cpu_ops

    step = worker.runner.cpu_step
    if step is None:
        raise SystemExit("the runner has no C step here (no compiler, or --enforce-eager)")
    libs = {"new": step.lib, "base": build_base(rev)}
    kernels, attend = _cpu_ops.tiled_kernels, CAttention.attend_qkv
    chosen = [libs["new"]]

    def attend_with(self: CAttention, *a: torch.Tensor) -> torch.Tensor:
        self.decode.lib = chosen[0]
        try:
            return attend(self, *a)
        finally:
            self.decode.lib = libs["new"]

    decoding = prompts(mixed, len(batch[0]), worker.runner.model_config.vocab_size)

    def measure() -> float:
        if not mixed:
            return step_ms(worker, batch, clock)
        steps = decode_and_mixed(worker, decoding, 12, SamplingOptions(temperature=0.0), clock)
        return statistics.median(s["wall"] for s in steps[1]) * 1e3

    sides: dict[str, list[float]] = {"new": [], "base": []}
    CAttention.attend_qkv = attend_with  # type: ignore[method-assign]
    try:
        for r in range(repeats):
            for side in ("new", "base") if r % 2 == 0 else ("base", "new"):
                lib = chosen[0] = libs[side]
                _cpu_ops.tiled_kernels = lambda lib=lib: lib  # type: ignore[misc]
                CAttention.native_bf16 = side == "new"
                sides[side].append(measure())
    finally:
        _cpu_ops.tiled_kernels, CAttention.native_bf16 = kernels, True
        CAttention.attend_qkv = attend  # type: ignore[method-assign]
    n, b = statistics.median(sides["new"]), statistics.median(sides["base"])
    both = zip(sides["new"], sides["base"], strict=True)
    pairs = statistics.median(x / y for x, y in both)
    what = f"mixed steps ({mixed} decodes + a prompt)" if mixed else "steps"
    print(f"{what}, {repeats} pairs against {rev}: new median {n:.1f} ms, base {b:.1f} ms, "
          f"new / base {n / b:.3f} (median of the pairs' ratios {pairs:.3f}); new "
          + " ".join(f"{x:.0f}" for x in sides["new"])
          + "; base " + " ".join(f"{x:.0f}" for x in sides["base"]))  # fmt: skip


if __name__ == "__main__":
    main()
