from __future__ import annotations

import pytest

from .figures import RECORDED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not RECORDED:
        return
    terminalreporter.section("reliability figures")
    for f in sorted(RECORDED, key=lambda f: f.case):
        terminalreporter.write_line(f"case {f.case:2d}  {f.what}: {f.value:g} {f.unit}")
