"""When a dead engine may be started again: at most `max_restarts` within `window` seconds.

The frontend owns every request's prompt and streamed tokens, so an engine's death need not
end the server: the engine is started again under the same config and serves again. A
crash loop must still end: past the bound the death is final (exit 1 with the cause, as
without restarts), and an engine that dies while starting is never started again.
"""

from __future__ import annotations

import time
from collections import deque


class RestartPolicy:
    """Counts restarts in a sliding window; `max_restarts` 0 never restarts."""

    def __init__(self, max_restarts: int, window: float) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_engine_restarts must be >= 0, got {max_restarts}")
        if window <= 0:
            raise ValueError(f"engine_restart_window must be > 0 seconds, got {window}")
        self.max_restarts = max_restarts
        self.window = window
        self.total = 0
        self._times: deque[float] = deque()

    def allow(self, now: float | None = None) -> bool:
        """Whether one more restart fits in the window (counted if so)."""
        now = time.monotonic() if now is None else now
        while self._times and now - self._times[0] > self.window:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        self.total += 1
        return True

    def describe_refusal(self) -> str:
        if self.max_restarts == 0:
            return "engine restarts are off (--no-engine-restart)"
        return (
            f"{self.max_restarts} restarts within {self.window:g} s already "
            f"(--max-engine-restarts, --engine-restart-window)"
        )
