"""Figures the fault cases measure (docs/reliability.md quotes them).

Each case calls `record(case, what, value, unit)`. The figures are printed in pytest's terminal
summary, and appended as JSON lines to `$TRILLM_RELIABILITY_FIGURES` when that is set:

    TRILLM_RELIABILITY_FIGURES=/tmp/figures.jsonl .venv/bin/python -m pytest tests/faults
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Figure:
    case: int
    what: str
    value: float
    unit: str


RECORDED: list[Figure] = []

# The bound for "at once" in a case's assertion (seconds): about 60x what a quiet AVX-512
# machine measures for the slowest of them (33 ms for 64 streams to end after a SIGKILL), so it
# holds on a machine 4x slower with the other core busy, and still far below every timeout that
# could have ended them instead (the watchdog's 30 s, a stream's max_tokens). The figure
# itself is recorded for docs/reliability.md; the assertion only proves the cause.
AT_ONCE = 2.0


def record(case: int, what: str, value: float, unit: str) -> None:
    """Keep one measured figure of case `case` (numbered as in docs/reliability.md)."""
    figure = Figure(case, what, round(float(value), 3), unit)
    RECORDED.append(figure)
    path = os.environ.get("TRILLM_RELIABILITY_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(asdict(figure)) + "\n")
