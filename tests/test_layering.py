"""The package layering of DESIGN.md §1, enforced: who may import whom inside trillm."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parent.parent / "lib"

# package -> the trillm packages it must never import
FORBIDDEN = {
    "transport_shm": {"engine", "gpu", "http"},
    "gpu": {"engine", "http"},
    "engine": {"http"},
}


def trillm_imports(path: Path, package: str, lib: Path = LIB) -> set[str]:
    """The top-level trillm packages that the module at `path` imports."""
    found = set()
    depth_of_module = len(path.relative_to(lib).parts) - 1  # 1 for lib/engine/x.py
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names = [node.module or ""]
            else:
                up = depth_of_module - (node.level - 1)
                base = list(path.relative_to(lib).parts[:up])
                module = (node.module or "").split(".") if node.module else []
                parts = base + module
                if not parts:  # `from .. import engine`
                    parts = [alias.name for alias in node.names][:1]
                names = ["trillm." + ".".join(parts)]
        else:
            continue
        for name in names:
            if name.startswith("trillm."):
                found.add(name.split(".")[1])
    return found - {package}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_respect_the_layering(package: str) -> None:
    violations = []
    for path in sorted((LIB / package).rglob("*.py")):
        bad = trillm_imports(path, package) & FORBIDDEN[package]
        if bad:
            violations.append(f"{path.relative_to(LIB)} imports {sorted(bad)}")
    assert not violations, "layering broken (DESIGN.md §1): " + "; ".join(violations)


def test_the_checker_sees_relative_and_absolute_imports(tmp_path: Path) -> None:
    module = tmp_path / "transport_shm" / "_probe.py"
    module.parent.mkdir()
    module.write_text("from ..engine import x\nimport trillm.http.app\nfrom . import _ring\n")
    assert trillm_imports(module, "transport_shm", tmp_path) == {"engine", "http"}


def test_no_top_level_http_package_shadows_the_stdlib() -> None:
    import http.client

    assert "site-packages" not in (http.client.__file__ or "")
    assert not (LIB.parent / "http").exists()
