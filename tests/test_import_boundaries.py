"""Import boundaries between roles: a worker never loads the scheduler, the scheduler never the client,
and nothing but the CLI loads the CLI."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).resolve().parents[1] / "workers"


def test_worker_entry_points_load_no_scheduler_module(tmp_path: Path) -> None:
    # a fresh interpreter (sys.modules of this test run is full of everything), started in a temp
    # cwd with -P so that the repo root's kernels/ folder does not shadow an installed package
    code = ("import batchinfer.workers.service.daemon, batchinfer.workers.service.serve, sys; "
            "print(sorted(m for m in sys.modules if m.startswith('batchinfer.scheduler')))")
    out = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_no_module_under_workers_imports_the_scheduler() -> None:
    # the static form of the test above, for modules the two entry points do not load
    offenders = []
    for path in sorted(WORKERS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):  # also `from batchinfer import scheduler`
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            offenders += [f"{path.relative_to(WORKERS)}: {n}" for n in names
                          if n == "batchinfer.scheduler" or n.startswith("batchinfer.scheduler.")]
    assert offenders == []


def _importers_of(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports at run time (tests/test_layout.py's graph)."""
    from test_layout import _modules, import_graph

    graph = import_graph(_modules())
    return {m: {d for d in deps if d == package or d.startswith(package + ".")}
            for m, deps in graph.items()}


def test_nothing_outside_the_cli_imports_the_cli() -> None:
    # the cli sits on top: an engine or daemon module importing it (as the weight loader once did
    # for its progress bar) would load click and the commands into every worker
    offenders = {m: d for m, d in _importers_of("batchinfer.cli").items()
                 if d and not m.startswith("batchinfer.cli")}
    assert offenders == {}


def test_the_scheduler_imports_no_client_code() -> None:
    offenders = {m: d for m, d in _importers_of("batchinfer.client").items()
                 if d and m.startswith("batchinfer.scheduler")}
    assert offenders == {}


def test_cli_commands_load_no_pyarrow(tmp_path: Path) -> None:
    """`status`, `--help` and the error mapping every command runs (InputError -> exit 7) stay free of
    pyarrow: only the commands that read or write tables load it."""
    code = """
import sys
from click.testing import CliRunner
import batchinfer.redis_conn
from batchinfer.cli import context
from batchinfer.cli.main import cli
from batchinfer.datasets.errors import InputError

batchinfer.redis_conn.RETRIES = 0
runner = CliRunner()
for args in (["--help"], ["submit", "--help"], ["run", "--help"], ["nightly", "--help"],
             ["--redis-url", "redis://127.0.0.1:1/0", "status", "j1"]):
    result = runner.invoke(cli, args)
    assert result.exit_code in (0, context.EXIT_REDIS), (args, result.output)

@context.handle_errors
def refused():
    raise InputError("refused")

try:
    refused()
except SystemExit as e:
    assert e.code == context.EXIT_INPUT, e.code
print(sorted(m for m in sys.modules if m == "pyarrow" or m.startswith("pyarrow.")))
"""
    out = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
