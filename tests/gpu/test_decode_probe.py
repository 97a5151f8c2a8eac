"""The decode paths measured at start-up (`_decode_probe`) on the real runner: forced by
`cpu_decode`, measured once and cached, re-measured over a corrupt cache, bounded in time,
and routing the runner's decode steps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from trillm.common.config import WorkerConfigError
from trillm.gpu import ModelRunner, TensorParallel, WorkerConfig, open_model
from trillm.gpu.cpu import _decode_probe
from trillm.gpu.cpu._decode_paths import DecodePaths, DecodeTiming
from trillm.gpu.cpu._tiles import tiled_kernels
from trillm.gpu.worker._startup_log import StartupLog

from .conftest import make_runner, save_tiny
from .driver import Driver, DriverRequest

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(tiled_kernels() is None, reason="no C compiler here: no C step"),
]
PROMPTS = [list(range(100 + 13 * i, 109 + 13 * i)) for i in range(4)]
N = 5  # tokens a request: the prompts' step, then 4 decode steps of 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("decode-probe"), "llama")


@pytest.fixture
def timed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The probe's cache in `tmp_path`; the list counts its timed steps."""
    monkeypatch.setattr(_decode_probe, "paths_dir", lambda: tmp_path / "decode_paths")
    calls: list[int] = []
    time_step = _decode_probe.time_step

    def counted(run: Callable[[], object]) -> float:
        calls.append(1)
        return float(time_step(run))

    monkeypatch.setattr(_decode_probe, "time_step", counted)
    return calls


def _runner(
    model_dir: Path, log: StartupLog | None = None, kv_cache_bytes: int = 1 << 30
) -> ModelRunner:
    """`make_runner` under `cpu_decode="auto"` (4 sequences at most: sizes 1 and 4 measured)
    with a start-up log."""
    config = WorkerConfig(
        str(model_dir), device="cpu", max_num_seqs=4, kv_cache_bytes=kv_cache_bytes
    )
    model_config, weights = open_model(config.model, config.load_format)
    runner = ModelRunner(config, model_config, TensorParallel(), torch.device("cpu"))
    runner.load_model(weights, log)
    runner.init_kv_cache(64)
    return runner


def _greedy(runner: ModelRunner) -> list[list[int]]:
    requests = [DriverRequest(i, p, N) for i, p in enumerate(PROMPTS)]
    Driver(runner, 64).run(requests)
    return [r.output for r in requests]


def test_cpu_decode_must_be_auto_c_or_torch() -> None:
    with pytest.raises(WorkerConfigError, match=r"^cpu_decode 'C' is not one of auto, c, torch$"):
        WorkerConfig("m", cpu_decode="C")


def test_c_and_torch_force_each_path_and_measure_nothing(tiny: Path, timed: list[int]) -> None:
    c = make_runner(tiny, cpu_decode="c", max_num_seqs=4)
    on_torch = make_runner(tiny, cpu_decode="torch", max_num_seqs=4)
    assert _greedy(c) == _greedy(on_torch)
    assert c.cpu_step is not None and on_torch.cpu_step is not None
    assert (c.cpu_step.num_runs, c.cpu_step.num_attention_steps) == (N - 1, 1)
    assert (on_torch.cpu_step.num_runs, on_torch.cpu_step.num_attention_steps) == (0, N)
    assert c.kernels is not None and c.kernels.decode.startswith("c (one call per step of up to 4")
    assert on_torch.kernels is not None
    assert on_torch.kernels.decode.startswith("torch with C's attention (--cpu-decode torch; ")
    assert "every step's attention in C" in on_torch.kernels.decode
    assert timed == []


def test_auto_measures_once_and_the_next_start_reads_the_cache(
    tiny: Path, tmp_path: Path, timed: list[int]
) -> None:
    log = StartupLog(enabled=False)
    first = _runner(tiny, log)
    assert first.cpu_step is not None
    paths = first.cpu_step.paths
    assert [t.batch for t in paths.timings] == [1, 4] and not paths.cached
    assert len(timed) == 2 * (1 + _decode_probe.RUNS) * 2  # a warm-up and RUNS, 2 paths, 2 sizes
    assert first.cpu_step.num_runs == first.cpu_step.num_attention_steps == 0  # not served
    assert "decode paths measured" in [name for name, _ in log.phases]
    assert (
        first.kernels is not None and " by measurement (ms, c / torch: 1 " in first.kernels.decode
    )
    assert len(list((tmp_path / "decode_paths").glob("*.json"))) == 1
    log = StartupLog(enabled=False)
    second = _runner(tiny, log)
    assert second.cpu_step is not None and second.cpu_step.paths.cached
    assert second.cpu_step.paths.timings == paths.timings
    assert len(timed) == 2 * (1 + _decode_probe.RUNS) * 2  # nothing measured again
    assert "decode paths read from the cache" in [name for name, _ in log.phases]
    assert second.kernels is not None and "; cached; " in second.kernels.decode
    assert _greedy(second) == _greedy(make_runner(tiny, max_num_seqs=4))  # either path's tokens


def test_a_corrupt_cache_file_is_measured_again(
    tiny: Path, tmp_path: Path, timed: list[int]
) -> None:
    _runner(tiny)
    (saved,) = (tmp_path / "decode_paths").glob("*.json")
    measured = len(timed)
    for junk in (b"{not json", b'{"key": {}, "timings": []}'):
        saved.write_bytes(junk)
        runner = _runner(tiny)
        assert runner.cpu_step is not None and not runner.cpu_step.paths.cached
        assert len(timed) > measured
        measured = len(timed)
        assert saved.read_bytes() != junk  # written again, whole
    assert not list((tmp_path / "decode_paths").glob("*.tmp"))


def test_past_the_budget_larger_sizes_are_not_measured(
    tiny: Path, timed: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_decode_probe, "BUDGET_S", 0.0)
    runner = _runner(tiny)
    assert runner.cpu_step is not None
    paths = runner.cpu_step.paths
    assert [t.batch for t in paths.timings] == [1]  # 4 takes 1's winner
    assert paths.note == "measured up to 1 in 0 s, larger steps as 1"
    assert len(timed) == 2 * 2  # a warm-up and one run a path: the budget was spent
    assert runner.kernels is not None and paths.note in runner.kernels.decode


def test_the_probe_cache_stays_within_the_kv_budget(tiny: Path, timed: list[int]) -> None:
    """A 64-token sequence of the tiny model is 4 blocks of 8 KiB: 40000 bytes hold one (size
    4 takes size 1's winner), 100 bytes none (nothing measured: the C step, as before)."""
    one = _runner(tiny, kv_cache_bytes=40000)
    assert one.cpu_step is not None and [t.batch for t in one.cpu_step.paths.timings] == [1]
    assert one.cpu_step.paths.note == "measured up to 1 (KV budget), larger steps as 1"
    measured = len(timed)
    none = _runner(tiny, kv_cache_bytes=100)
    assert none.cpu_step is not None and none.cpu_step.paths.forced == "c"
    assert none.kernels is not None and none.kernels.decode.startswith(
        "c (one call per step of up to 4 decodes; not measured: the KV budget holds no "
        "64-token sequence; "
    )
    assert len(timed) == measured


@pytest.mark.parametrize("c_wins_at_4", [True, False])
def test_the_table_routes_the_runners_decode_steps(tiny: Path, c_wins_at_4: bool) -> None:
    runner = make_runner(tiny, max_num_seqs=4)
    assert runner.cpu_step is not None
    c_at_4 = (2.0, 3.0) if c_wins_at_4 else (3.0, 2.0)
    runner.cpu_step.paths = DecodePaths((DecodeTiming(1, 1.0, 2.0), DecodeTiming(4, *c_at_4)))
    _greedy(runner)  # 4 decodes a step
    decodes = N - 1
    assert runner.cpu_step.num_runs == (decodes if c_wins_at_4 else 0)
    assert runner.cpu_step.num_attention_steps == 1 + (0 if c_wins_at_4 else decodes)
    alone = make_runner(tiny, max_num_seqs=4)
    assert alone.cpu_step is not None
    alone.cpu_step.paths = runner.cpu_step.paths
    Driver(alone, 64).run([DriverRequest(0, PROMPTS[0], N)])  # 1 decode a step: C's either way
    assert alone.cpu_step.num_runs == decodes
