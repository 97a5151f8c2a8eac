"""A worker's failure record names the function that raised, preferring trillm's own code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trillm.gpu import WorkerFailure
from trillm.gpu.loader._weights import safetensors_files
from trillm.gpu.worker._failure import raised_in


def test_the_innermost_trillm_frame_is_named_over_deeper_foreign_ones(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text("{")
    with pytest.raises(ValueError) as info:  # raised inside the json package, called by trillm
        safetensors_files(tmp_path)
    assert raised_in(info.value).startswith("safetensors_files (_weights.py:")

    def parse() -> object:
        return json.loads("{")  # no trillm frame at all: the innermost frame

    with pytest.raises(ValueError) as foreign:
        parse()
    assert raised_in(foreign.value).startswith("JSONDecoder.raw_decode (decoder.py:")


def test_a_failure_record_carries_the_function() -> None:
    def forward() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError) as info:
        forward()
    failure = WorkerFailure.from_exception(1, info.value)
    assert failure.function.startswith(
        "test_a_failure_record_carries_the_function.<locals>.forward (test_failure.py:"
    )
    assert (failure.rank, failure.exc_type, failure.message) == (1, "RuntimeError", "boom")
    assert raised_in(RuntimeError("never raised")) == ""
