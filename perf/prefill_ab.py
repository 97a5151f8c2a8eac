"""Two settings of `prefill_profile.py`, run alternately in fresh processes: medians and ratios.

A process-wide setting (malloc's thresholds) cannot be switched inside one process, and a
loaded machine drifts, so each round runs A then B (B then A on odd rounds), each its own
process, and the medians of the per-process medians are compared.

    python perf/prefill_ab.py [--rounds 3] [--a=FLAGS] [--b=--torch-norm] -- [prefill_profile args]

Prints per round the step median, the first step (the warm-up) and the page faults of each
side, then the medians of both over the rounds and B / A.
"""

from __future__ import annotations

import argparse
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "prefill_profile.py"


def run(flags: list[str]) -> tuple[float, float, float, float]:
    """(median step ms, first step ms, first step's page faults, a later step's) of one
    prefill_profile.py process."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, check=True
    ).stdout
    median = re.search(r"median ([\d.]+) ms", out)
    first = re.search(r"first step ([\d.]+) ms", out)
    faults = re.search(r"page faults: first step (\d+), then (\d+) a step", out)
    if median is None or first is None or faults is None:
        raise RuntimeError(f"prefill_profile.py printed no median:\n{out}")
    return (
        float(median.group(1)),
        float(first.group(1)),
        float(faults.group(1)),
        float(faults.group(2)),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--a", default="", help="flags of side A (the baseline)")
    p.add_argument("--b", default="--torch-norm", help="flags of side B")
    p.add_argument("rest", nargs="*", help="prefill_profile.py flags for both sides")
    args = p.parse_args()
    sides = {"A": shlex.split(args.a), "B": shlex.split(args.b)}
    results: dict[str, list[tuple[float, float, float, float]]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            results[name].append(run([*sides[name], *args.rest]))
            print(f"round {r} {name} {args.a if name == 'A' else args.b!r}: "
                  + _line(results[name][-1]), flush=True)  # fmt: skip
    a = [statistics.median(x[i] for x in results["A"]) for i in range(4)]
    b = [statistics.median(x[i] for x in results["B"]) for i in range(4)]
    print(f"A {args.a!r}: {_line(a)}")
    print(f"B {args.b!r}: {_line(b)}")
    names = ("steps", "first step", "its faults", "a step's faults")
    ratios = ", ".join(
        f"{what} {y / x:.3f}" if x else f"{what} {x:.0f} -> {y:.0f}"
        for what, x, y in zip(names, a, b, strict=True)
    )
    print(f"B / A: {ratios}")


def _line(r: tuple[float, ...] | list[float]) -> str:
    return (
        f"median step {r[0]:.1f} ms, first step {r[1]:.1f} ms; page faults: first step "
        f"{r[2]:.0f}, then {r[3]:.0f} a step"
    )


if __name__ == "__main__":
    main()
