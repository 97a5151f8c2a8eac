"""The decode path by step size (`_decode_paths`): the routing rule on hand-made tables."""

from __future__ import annotations

import pytest

from trillm.gpu.cpu._decode_paths import C_STEP, TORCH, DecodePaths, DecodeTiming


def _table(*rows: tuple[int, float, float], **kw: object) -> DecodePaths:
    return DecodePaths(tuple(DecodeTiming(*row) for row in rows), **kw)  # type: ignore[arg-type]


def _c_sizes(paths: DecodePaths, up_to: int = 64) -> list[int]:
    return [n for n in range(1, up_to + 1) if paths.takes_c_step(n)]


def test_torch_winning_at_large_steps_takes_them_from_the_smallest_measured_size_above() -> None:
    paths = _table((1, 8.2, 15.1), (4, 9.0, 18.3), (16, 20.1, 25.3), (32, 41.0, 39.8))
    assert _c_sizes(paths) == list(range(1, 17))  # 17-32 by 32's winner, above it too
    assert paths.routing(64) == "c up to 16 decodes, torch above"
    assert paths.describe(64) == (
        "c by measurement (ms, c / torch: 1 8.2/15.1, 4 9.0/18.3, 16 20.1/25.3, 32 41.0/39.8; "
        "c up to 16 decodes, torch above"
    )


def test_c_winning_everywhere_takes_every_size_up_to_its_bound() -> None:
    paths = _table((1, 8.0, 15.0), (4, 9.0, 18.0), (16, 20.0, 25.0), cached=True)
    assert _c_sizes(paths, 200) == list(range(1, 201))  # `CpuStep.covers` bounds it
    assert paths.describe(64) == (
        "c by measurement (ms, c / torch: 1 8.0/15.0, 4 9.0/18.0, 16 20.0/25.0; "
        "c up to 64 decodes; cached"
    )


def test_c_losing_everywhere_is_never_taken() -> None:
    paths = _table((1, 30.0, 15.0), (4, 40.0, 18.0), (64, 400.0, 90.0))
    assert _c_sizes(paths) == []
    assert paths.describe(64).startswith("torch by measurement (")
    assert paths.routing(64) == "torch at every size"


def test_a_table_that_changes_winner_twice_routes_each_span() -> None:
    paths = _table((1, 8.0, 9.0), (4, 12.0, 9.0), (16, 12.0, 20.0), note="budget spent")
    assert _c_sizes(paths, 20) == [1, *range(5, 21)]
    assert paths.routing(64) == "c for 1, 5-64 decodes, torch for 2-4"
    assert paths.describe(64).endswith("; c for 1, 5-64 decodes, torch for 2-4; budget spent")


@pytest.mark.parametrize(("paths", "c"), [(C_STEP, True), (TORCH, False)])
def test_forced_paths_ignore_the_size(paths: DecodePaths, c: bool) -> None:
    assert all(paths.takes_c_step(n) == c for n in (1, 16, 64))
    opening = "c (one call per step of up to 64 decodes" if c else "torch with C's attention ("
    assert paths.describe(64).startswith(opening)
