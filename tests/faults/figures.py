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


def record(case: int, what: str, value: float, unit: str) -> None:
    """Keep one measured figure of case `case` (numbered as in docs/reliability.md)."""
    figure = Figure(case, what, round(float(value), 3), unit)
    RECORDED.append(figure)
    path = os.environ.get("TRILLM_RELIABILITY_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(asdict(figure)) + "\n")
