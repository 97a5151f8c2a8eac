"""`--plot`: latency CDFs (TTFT, TPOT, E2EL) and a per-request timeline, as one PNG.

matplotlib is optional (not a project dependency): `require_matplotlib` runs before the
benchmark, so a missing install fails in a second, not after a long run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _bench_metrics import RequestOutput


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed."""


def require_matplotlib() -> None:
    """Raises PlotUnavailableError, naming the install command, when matplotlib is missing."""
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
    except ImportError:
        raise PlotUnavailableError(
            "--plot needs matplotlib, which is not installed: "
            "run `.venv/bin/pip install matplotlib` or drop --plot"
        ) from None


def _cdf(ax: Any, values_ms: Sequence[float], title: str) -> None:
    xs = np.sort(np.asarray(values_ms))
    ys = np.arange(1, len(xs) + 1) / max(len(xs), 1)
    ax.step(xs, ys, where="post")
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)


def save_plot(outputs: Sequence[RequestOutput], path: Path) -> None:
    """Three CDFs on top; below, one bar per request from start to end, TTFT darker."""
    require_matplotlib()
    import matplotlib  # type: ignore[import-not-found, unused-ignore]

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]

    done = [o for o in outputs if o.success]
    fig = plt.figure(figsize=(14, 9))
    grid = fig.add_gridspec(2, 3)
    _cdf(fig.add_subplot(grid[0, 0]), [o.ttft * 1e3 for o in done], "TTFT")
    tpots = [t * 1e3 for o in done if (t := o.tpot) is not None]
    _cdf(fig.add_subplot(grid[0, 1]), tpots, "TPOT")
    _cdf(fig.add_subplot(grid[0, 2]), [o.latency * 1e3 for o in done], "E2EL")
    timeline = fig.add_subplot(grid[1, :])
    for i, o in enumerate(outputs):
        if not o.success:
            timeline.plot([o.start_time], [i], "rx")
            continue
        timeline.barh(i, o.ttft, left=o.start_time, color="tab:orange", height=0.8)
        timeline.barh(
            i, o.latency - o.ttft, left=o.start_time + o.ttft, color="tab:blue", height=0.8
        )
    timeline.set_title("requests: queue + prefill until the first token (orange), decode (blue)")
    timeline.set_xlabel("seconds since the start")
    timeline.set_ylabel("request")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
