"""The package's shape: no import circles, and folders small enough to read by their names.

Imports are read from the source (``ast``), not by importing, so that lazy imports inside functions
count too: a circle closed by a late import still loads a module half-initialised, or twice under
``python -m``. Imports under ``if TYPE_CHECKING:`` are left out: they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
# Past this many modules directly in one folder, a reader can no longer tell roles from names alone.
MAX_MODULES_PER_FOLDER = 12


def _package_dirs() -> dict[str, Path]:
    """Every package of the distribution (pyproject's explicit list) -> its folder."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = config["package-dir"]
    folders = {}
    for package in config["packages"]:
        # The deepest package-dir entry above a package gives its folder (batchinfer.workers.engine
        # = workers/engine; batchinfer.cli = batchinfer/cli).
        base = max((name for name in mapped if package == name or package.startswith(name + ".")), key=len)
        folders[package] = ROOT / mapped[base] / package[len(base):].lstrip(".").replace(".", "/")
    return folders


def _modules() -> dict[str, Path]:
    """Every module of the distribution by import name (packages by their ``__init__.py``)."""
    modules: dict[str, Path] = {}
    for package, folder in _package_dirs().items():
        for path in folder.glob("*.py"):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def test_every_package_and_module_is_seen():
    modules = _modules()
    assert {"batchinfer.cli.main", "batchinfer.store.jobstore", "batchinfer.workers.engine.engine",
            "batchinfer.kernels.dispatch", "batchinfer.jobs.export"} <= set(modules)
    assert all(path.is_file() for path in modules.values())


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """What a module imports at run time: ``(module, names)`` per statement (``import a`` gives
    ``("a", [])``)."""
    found: list[tuple[str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names]))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports. ``from pkg import sub`` (a submodule) is an edge to
    ``pkg.sub`` alone: a package's ``__init__`` is already running whenever its submodules load, so
    counting it would make every package a circle; ``from pkg import name`` is an edge to ``pkg``."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for module, names in _imports(ast.parse(path.read_text(), filename=str(path))):
            submodules = {f"{module}.{n}" for n in names if f"{module}.{n}" in modules}
            deps |= submodules
            if len(submodules) < len(names) or not names:
                deps.add(module)
        graph[name] = {dep for dep in deps if dep in modules and dep != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return cycles


def test_the_cycle_finder_finds_a_circle_closed_by_a_late_import(tmp_path):
    # The shape cli/runner.py <-> cli/main.py had: one side imports the other inside a function.
    (tmp_path / "a.py").write_text("import pkg.b\n")
    (tmp_path / "b.py").write_text("def f():\n    from pkg.a import x\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n")
    modules = {f"pkg.{p.stem}": p for p in tmp_path.glob("*.py")}
    graph = import_graph(modules)
    assert graph["pkg.c"] == set()
    assert find_cycles(graph) == [["pkg.a", "pkg.b"]]


def test_no_import_circles():
    cycles = find_cycles(import_graph(_modules()))
    assert cycles == [], f"import circles: {cycles}"


def test_every_folder_stays_small():
    crowded = {package: count for package, folder in _package_dirs().items()
               if (count := sum(1 for p in folder.glob("*.py") if p.stem != "__init__"))
               > MAX_MODULES_PER_FOLDER}
    assert crowded == {}, f"folders with more than {MAX_MODULES_PER_FOLDER} modules: {crowded}"


def test_top_level_holds_only_cross_cutting_modules():
    top = sorted(p.stem for p in (ROOT / "batchinfer").glob("*.py"))
    assert top == ["__init__", "clock", "config", "keys", "redis_conn"]


# -- packages: a DAG, and the inference library apart from the queue -------------------------------

# The inference library (docs/architecture.md "Dependency rules"): importable and usable with no
# Redis. batchinfer.workers.service is not part of it: it is the worker service that feeds it.
LIBRARY = ("batchinfer.workers", "batchinfer.kernels")
SERVICE = "batchinfer.workers.service"
QUEUE_SIDE = ("batchinfer.store", "batchinfer.redis_conn", "batchinfer.protocol", "batchinfer.scheduler",
              "batchinfer.client", "batchinfer.cli", "batchinfer.ops", "batchinfer.jobs", "batchinfer.config",
              "batchinfer.keys", "batchinfer.datasets")


def _under(module: str, roots: tuple[str, ...] | str) -> bool:
    roots = (roots,) if isinstance(roots, str) else roots
    return any(module == r or module.startswith(r + ".") for r in roots)


def package_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Package -> the packages its modules import (a package's own modules, not its sub-packages)."""
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}

    def package(module: str) -> str:
        return module if module in packages else module.rsplit(".", 1)[0]

    graph: dict[str, set[str]] = {p: set() for p in packages}
    for module, deps in import_graph(modules).items():
        graph[package(module)] |= {package(d) for d in deps} - {package(module)}
    return graph


def test_the_package_graph_is_read_per_package(tmp_path):
    # a.x imports b.y and b.z imports a.w: no module circle, but a package circle
    for folder, body in (("a", "import pkg.b.y\n"), ("b", "def f():\n    import pkg.a.w\n")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
        (tmp_path / folder / ("x.py" if folder == "a" else "z.py")).write_text(body)
    (tmp_path / "a" / "w.py").write_text("")
    (tmp_path / "b" / "y.py").write_text("")
    modules = {f"pkg.{p.parent.name}" if p.stem == "__init__" else f"pkg.{p.parent.name}.{p.stem}": p
               for p in tmp_path.rglob("*.py")}
    assert find_cycles(import_graph(modules)) == []
    assert find_cycles(package_graph(modules)) == [["pkg.a", "pkg.b"]]


def test_no_package_circles():
    cycles = find_cycles(package_graph(_modules()))
    assert cycles == [], f"package circles: {cycles}"


def test_the_library_imports_nothing_of_the_queue_side():
    offenders = {m: sorted(d for d in deps if _under(d, QUEUE_SIDE) or _under(d, SERVICE))
                 for m, deps in import_graph(_modules()).items()
                 if _under(m, LIBRARY) and not _under(m, SERVICE)}
    assert {m: d for m, d in offenders.items() if d} == {}


def test_the_library_loads_without_redis(tmp_path):
    """The runtime form: LLM, the engines and every library package import no redis module."""
    import subprocess
    import sys

    library = sorted(m for m in _modules() if _under(m, LIBRARY) and not _under(m, SERVICE)
                     and not m.endswith(("xgrammar_backend", "xgrammar_vocab", "flash")))  # optional imports
    banned = ("redis", "rq", *QUEUE_SIDE, SERVICE)
    code = (f"import importlib, sys\nfor m in {library!r}:\n    importlib.import_module(m)\n"
            f"banned = {banned!r}\n"
            "print(sorted(m for m in sys.modules if any(m == b or m.startswith(b + '.') for b in banned)))")
    done = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout


# What the wire format may know of the library: the parameters a request carries, never the
# engine's types (turning an engine output into a row is the worker service's: workers/service/rows.py).
REQUEST_VOCABULARY = {"batchinfer.workers.sampling_params", "batchinfer.workers.pooling_params",
                      "batchinfer.workers.structured_params", "batchinfer.workers.lora_request",
                      # a request's tools (ToolSpec, parse_tools): pure data, no torch
                      "batchinfer.workers.tools", "batchinfer.workers.tools.spec"}


def test_the_wire_format_knows_only_the_request_parameters_of_the_library():
    offenders = {m: sorted(d for d in deps if _under(d, LIBRARY) and d not in REQUEST_VOCABULARY)
                 for m, deps in import_graph(_modules()).items() if _under(m, "batchinfer.protocol")}
    assert {m: d for m, d in offenders.items() if d} == {}
