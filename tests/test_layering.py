"""The package layering of DESIGN.md §1 and the walls of §11, enforced: who may import whom.

Four kinds of rule. Between packages: `transport_shm` <- `gpu` <- `engine` <- `http`, and
no package imports another's private modules. Inside `engine`, by process: `core` (the engine
process) and `client` (the frontend process) never import each other and meet only in
`protocol`, the wire they share; the frontend starts the engine by its entry point's name,
never by importing it; `http` sees only the client's public names. And by what an import
loads: the API process's packages, imported in a fresh interpreter, load no torch, triton,
`trillm.gpu` or engine-process code (statements alone cannot show it: a package's
`__init__` imports its siblings). And the rooms' walls inside `gpu` and `http` (§11): a model
never reaches the runner, the API faces reach each other only through `edge` and `turn`.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parent.parent / "lib"

# package -> the trillm packages it must never import. `common` imports nothing of trillm (every
# process reads it); nothing imports `cli`, the `trillm` parent process's command.
FORBIDDEN = {
    "common": {"cli", "default_model", "engine", "gpu", "http", "transport_shm"},
    "transport_shm": {"cli", "common", "default_model", "engine", "gpu", "http"},
    "gpu": {"cli", "default_model", "engine", "http"},
    "engine": {"cli", "http"},
    "http": {"cli", "default_model", "gpu"},
    "default_model.py": {"cli", "engine", "http"},
}

# What the API process must never load: the device side and the engine process's code.
NOT_IN_THE_API_PROCESS = ("torch", "triton", "trillm.gpu", "trillm.engine.core")

# engine sub-package -> the engine sub-packages it must never import
FORBIDDEN_IN_ENGINE = {
    "core": {"client"},
    "client": {"core"},
    "protocol": {"client", "core"},
}


def import_targets(path: Path, lib: Path = LIB) -> set[str]:
    """Everything of trillm's that the module at `path` imports, as dotted names.

    `from ..protocol import _messages as P` in lib/engine/core/x.py gives
    "trillm.engine.protocol._messages"; `from trillm.engine import AsyncLLM` gives
    "trillm.engine.AsyncLLM"; `import trillm.http` gives "trillm.http".
    """
    found: set[str] = set()
    package = package_of(path, lib)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = from_base(node, package)
            found.update(".".join([*base, alias.name]) for alias in node.names)
    return {name for name in found if name.startswith("trillm.")}


def package_of(path: Path, lib: Path = LIB) -> list[str]:
    """The package a module's relative imports start from: lib/engine/core/x.py (and
    lib/engine/core/__init__.py) -> trillm.engine.core."""
    return ["trillm", *path.relative_to(lib).parts[:-1]]


def from_base(node: ast.ImportFrom, package: list[str]) -> list[str]:
    """The dotted module a `from X import ...` names, its dots resolved from `package`."""
    if node.level == 0:
        return (node.module or "").split(".")
    base = package[: len(package) - (node.level - 1)]
    return base + (node.module.split(".") if node.module else [])


def trillm_imports(path: Path, package: str, lib: Path = LIB) -> set[str]:
    """The top-level trillm packages (other than `package`) that the module imports."""
    return {name.split(".")[1] for name in import_targets(path, lib)} - {package}


def engine_imports(path: Path, sub: str, lib: Path = LIB) -> set[str]:
    """The engine sub-packages (other than `sub`) that a module of lib/engine/SUB imports."""
    return {
        name.split(".")[2]
        for name in import_targets(path, lib)
        if name.startswith("trillm.engine.") and len(name.split(".")) >= 3
    } - {sub}


def is_public_client_name(target: str) -> bool:
    """`trillm.engine.client.X` or `trillm.engine.X`, X a public name (not core, protocol)."""
    parts = target.split(".")
    if parts[:3] == ["trillm", "engine", "client"]:
        return len(parts) == 4 and not parts[3].startswith("_")
    return len(parts) == 3 and not parts[2].startswith("_") and parts[2] not in ("core", "protocol")


def modules(package: str) -> list[Path]:
    if package.endswith(".py"):
        return [LIB / package]
    return sorted((LIB / package).rglob("*.py"))


def private_reach(path: Path, lib: Path = LIB) -> set[str]:
    """The private modules of other top-level packages that the module at `path` imports:
    `from ..gpu._worker_process import X` in lib/engine/core/x.py gives
    "trillm.gpu._worker_process"; a package's own private modules are its business."""
    rel = path.relative_to(lib)
    own = rel.parts[0] if len(rel.parts) > 1 else None
    found = set()
    for target in import_targets(path, lib):
        parts = target.split(".")
        for i, part in enumerate(parts[1:], start=1):
            if part.startswith("_") and not part.startswith("__"):
                if parts[1] != own:
                    found.add(".".join(parts[: i + 1]))
                break
    return found


def loaded_by(statement: str) -> list[str]:
    """Which of `NOT_IN_THE_API_PROCESS` a fresh interpreter holds after `statement`."""
    probe = (
        f"{statement}\nimport sys\n"
        f"print(' '.join(m for m in {NOT_IN_THE_API_PROCESS!r} if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.split()


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_respect_the_layering(package: str) -> None:
    violations = []
    for path in modules(package):
        bad = trillm_imports(path, package) & FORBIDDEN[package]
        if bad:
            violations.append(f"{path.relative_to(LIB)} imports {sorted(bad)}")
    assert not violations, "layering broken (DESIGN.md §1): " + "; ".join(violations)


@pytest.mark.parametrize("sub", sorted(FORBIDDEN_IN_ENGINE))
def test_engine_process_code_and_frontend_code_meet_only_in_the_protocol(sub: str) -> None:
    violations = []
    for path in modules(f"engine/{sub}"):
        bad = engine_imports(path, sub) & FORBIDDEN_IN_ENGINE[sub]
        if bad:
            violations.append(f"{path.relative_to(LIB)} imports engine.{sorted(bad)}")
    assert not violations, "process boundary broken (DESIGN.md §1): " + "; ".join(violations)


# gpu/models: a model is built from layers, attention and quantized weights, never from the
# runner, the worker or the loader that drive it.
MODELS_NEVER_IMPORT = {"runner", "worker", "loader", "sample", "spec_decode", "lora"}

# http: the API faces meet only in `edge` and `turn` (and `metrics`); `turn`, which every face
# runs, imports no face.
HTTP_FACES = {"openai", "responses", "anthropic", "pooling", "extras"}
# Today's crossings: the OpenAI chat schema is still the internal format that the Responses and
# Messages faces translate into (issue 49 item 3, the face-neutral conversation record); the
# `Edge` that stands in for the one exchange object (item 2) is edge's now (`edge/_steps`).
# Each goes with its item; no other may appear.
CROSSINGS_TO_GO = {
    ("anthropic/_api.py", "openai"),
    ("responses/_api.py", "openai"),
    ("responses/_face.py", "openai"),
    ("extras/_tokenize_api.py", "openai"),
    ("turn/_generate.py", "openai"),
    ("turn/_inputs.py", "openai"),
}


def room_imports(path: Path, top: str, lib: Path = LIB) -> set[str]:
    """The rooms of `trillm.<top>` (its sub-packages) other than its own that a module imports."""
    rel = path.relative_to(lib)
    own = rel.parts[1] if len(rel.parts) > 2 else None
    rooms = set()
    for target in import_targets(path, lib):
        parts = target.split(".")
        if parts[1] == top and len(parts) > 2 and not parts[2].startswith("_"):
            rooms.add(parts[2])
    return rooms - {own}


def test_lib_holds_packages_and_the_default_model_only() -> None:
    loose = sorted(p.name for p in LIB.glob("*.py"))
    assert loose == ["__init__.py", "default_model.py"], (
        f"modules at lib/'s top (records every process reads go to common/): {loose}"
    )


def test_gpu_and_http_are_rooms_with_few_modules_at_the_door() -> None:
    for top, most in (("gpu", 8), ("http", 8)):
        door = sorted(p.name for p in (LIB / top).glob("*.py"))
        assert len(door) <= most, f"lib/{top}/ holds {len(door)} modules at its top: {door}"


def test_no_folder_but_the_models_holds_more_than_16_modules() -> None:
    crowded = {
        str(d.relative_to(LIB)): n
        for d in [LIB, *(p for p in LIB.rglob("*") if p.is_dir())]
        if d.name != "__pycache__" and d != LIB / "gpu" / "models"
        if (n := len([m for m in d.glob("*.py") if m.name != "__init__.py"])) > 16
    }
    assert not crowded, f"folders over 16 modules (give them rooms): {crowded}"


def test_modules_stay_small() -> None:
    """STYLE rule 3: about 150 lines, never over 400 (a module past that is two ideas)."""
    sizes = sorted(
        (len(p.read_text().splitlines()), str(p.relative_to(LIB))) for p in LIB.rglob("*.py")
    )
    large = [f"{name} ({n})" for n, name in sizes if n > 400]
    assert not large, f"modules over 400 lines (split them by responsibility): {large}"
    median = sizes[len(sizes) // 2][0]
    assert median <= 150, f"the median module has {median} lines"


def test_every_folder_says_which_process_it_runs_in() -> None:
    silent = []
    for init in sorted(LIB.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if not doc:
            silent.append(str(init.relative_to(LIB)))
    assert not silent, f"folders whose __init__.py has no docstring: {silent}"


def test_a_model_never_reaches_the_runner() -> None:
    violations = []
    for path in modules("gpu/models"):
        bad = room_imports(path, "gpu") & MODELS_NEVER_IMPORT
        if bad:
            violations.append(f"{path.relative_to(LIB)} imports gpu.{sorted(bad)}")
    assert not violations, "gpu/models reaches what drives it: " + "; ".join(violations)


def test_the_api_faces_meet_only_in_edge_and_turn() -> None:
    found = set()
    for room in [*sorted(HTTP_FACES), "turn"]:
        for path in modules(f"http/{room}"):
            for face in room_imports(path, "http") & HTTP_FACES:
                found.add((str(path.relative_to(LIB / "http")), face))
    new = sorted(found - CROSSINGS_TO_GO)
    assert not new, f"an API face (or turn) imports another face: {new}"
    gone = sorted(CROSSINGS_TO_GO - found)
    assert not gone, f"crossings no longer there: take them out of CROSSINGS_TO_GO: {gone}"


def import_time_targets(path: Path, modules: set[str], lib: Path = LIB) -> set[str]:
    """Which of `modules` the module at `path` imports when it is imported: by its top-level
    statements (and classes, `try`, `if`), not its functions nor `if TYPE_CHECKING:`.
    `from PKG import a` imports PKG unless `a` is one of PKG's modules (then only `a`:
    PKG is the package being initialised)."""
    package = package_of(path, lib)
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.ClassDef | ast.With):
                visit(node.body)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.finalbody)
            elif isinstance(node, ast.ImportFrom):
                base = from_base(node, package)
                names = {".".join([*base, alias.name]) for alias in node.names}
                found.update(names & modules if names <= modules else {".".join(base)})
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)

    visit(ast.parse(path.read_text()).body)
    return found & modules


def module_name(path: Path, lib: Path = LIB) -> str:
    parts = list(path.relative_to(lib).with_suffix("").parts)
    return ".".join(["trillm", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def test_no_import_cycle_between_modules() -> None:
    paths = {module_name(p): p for p in LIB.rglob("*.py")}
    graph = {m: import_time_targets(p, set(paths)) - {m} for m, p in paths.items()}
    done: set[str] = set()
    cycles = []
    for start in sorted(graph):  # a depth-first walk; a module seen on its own path is a cycle
        stack: list[tuple[str, list[str]]] = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    cycles.append(" -> ".join([*path, nxt]))
                elif nxt not in path and nxt not in done:
                    stack.append((nxt, [*path, nxt]))
        done.add(start)
    assert not cycles, f"modules that import each other when imported: {cycles[:5]}"


def test_the_room_rule_sees_relative_imports(tmp_path: Path) -> None:
    module = tmp_path / "http" / "responses" / "_probe.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "from ..openai._requests import X\nfrom ..edge import _errors\nfrom . import _store\n"
        "from .._door import Y\n"
    )
    assert room_imports(module, "http", tmp_path) == {"openai", "edge"}


def test_every_engine_module_lives_in_the_folder_of_its_process() -> None:
    loose = [p.name for p in (LIB / "engine").glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"lib/engine/ modules outside client/, core/, protocol/: {loose}"
    assert {p.name for p in (LIB / "engine").iterdir() if p.is_dir()} - {"__pycache__"} == set(
        FORBIDDEN_IN_ENGINE
    )


def test_http_sees_only_the_clients_public_names() -> None:
    violations = []
    for path in modules("http"):
        for target in sorted(import_targets(path)):
            if target.startswith("trillm.engine") and not is_public_client_name(target):
                violations.append(f"{path.relative_to(LIB)} imports {target}")
    assert not violations, "http reaches past the engine client: " + "; ".join(violations)


def test_the_frontend_starts_the_engine_by_its_entry_point_name() -> None:
    from trillm.engine.protocol._messages import ENGINE_MAIN

    assert ENGINE_MAIN == "trillm.engine.core"
    spec = importlib.util.find_spec(ENGINE_MAIN + ".__main__")
    assert spec is not None and spec.origin == str(LIB / "engine" / "core" / "__main__.py")
    launch = (LIB / "engine" / "client" / "engines" / "_launch.py").read_text()
    assert "ENGINE_MAIN" in launch and "trillm.engine.core" not in launch


def test_the_checker_sees_relative_and_absolute_imports(tmp_path: Path) -> None:
    module = tmp_path / "transport_shm" / "_probe.py"
    module.parent.mkdir()
    module.write_text("from ..engine import x\nimport trillm.http.app\nfrom . import _ring\n")
    assert trillm_imports(module, "transport_shm", tmp_path) == {"engine", "http"}
    nested = tmp_path / "engine" / "client" / "_probe.py"
    nested.parent.mkdir(parents=True)
    nested.write_text(
        "from ..protocol import _messages as P\nfrom ..core._request import Request\n"
        "from ...gpu import WorkerConfig\nfrom . import _outputs\nimport trillm.engine.core\n"
    )
    assert engine_imports(nested, "client", tmp_path) == {"protocol", "core"}
    assert import_targets(nested, tmp_path) == {
        "trillm.engine.protocol._messages",
        "trillm.engine.core._request.Request",
        "trillm.gpu.WorkerConfig",
        "trillm.engine.client._outputs",
        "trillm.engine.core",
    }


def test_the_http_rule_tells_public_names_from_private_ones() -> None:
    assert is_public_client_name("trillm.engine.client.AsyncLLM")
    assert is_public_client_name("trillm.engine.Output")
    assert not is_public_client_name("trillm.engine.client._async_llm")
    assert not is_public_client_name("trillm.engine.core")
    assert not is_public_client_name("trillm.engine.protocol.EngineConfig")
    assert not is_public_client_name("trillm.engine._protocol")


def test_no_top_level_http_package_shadows_the_stdlib() -> None:
    import http.client

    assert "site-packages" not in (http.client.__file__ or "")
    assert not (LIB.parent / "http").exists()


@pytest.mark.parametrize(
    "statement",
    [
        "import trillm.http",
        "import trillm.engine.client",
        "import trillm.cli",
        "import trillm.common.config, trillm.common.wire, trillm.common.process",
        "from trillm import AsyncLLM, SamplingParams, LLMConfig, EngineConfig, WorkerConfig",
    ],
)
def test_the_api_process_loads_no_torch_nor_engine_code(statement: str) -> None:
    assert loaded_by(statement) == [], (
        f"`{statement}` loads the engine stack into the API process (DESIGN.md §8): find "
        "the import with `python -X importtime -c '...'`"
    )


def test_the_default_models_tokenizer_loads_without_torch() -> None:
    from trillm.default_model import default_model_dir

    model = default_model_dir(progress=False)
    statement = (
        "from trillm.engine.client.inputs._tokenizer import load_tokenizer\n"
        f"assert load_tokenizer({str(model)!r}).encode('hello world')"
    )
    assert loaded_by(statement) == []


def test_no_package_imports_another_packages_private_modules() -> None:
    violations = []
    for path in sorted(LIB.rglob("*.py")):
        for target in sorted(private_reach(path)):
            violations.append(f"{path.relative_to(LIB)} imports {target}")
    assert not violations, (
        "private modules reached across packages (import the package's public names): "
        + "; ".join(violations)
    )


def test_the_private_rule_tells_own_modules_from_others(tmp_path: Path) -> None:
    module = tmp_path / "engine" / "core" / "_probe.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "from ..protocol._messages import ADD\nfrom ...gpu._worker_process import W\n"
        "from ...gpu import worker_process\nfrom . import _request\n"
    )
    assert private_reach(module, tmp_path) == {"trillm.gpu._worker_process"}
