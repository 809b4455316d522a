"""Run mypy over the ``batchinfer`` package as it is installed, not as the folders are named.

The folders do not match their import names (``workers/`` is ``batchinfer.workers``, see
``[tool.setuptools.package-dir]`` in pyproject.toml), and the editable install maps them with an
import hook that mypy cannot follow. So this builds ``.typecheck/batchinfer/``, a tree of symlinks
laid out like the installed package, runs ``mypy -p batchinfer`` over it (``mypy_path`` in
``[tool.mypy]`` points there), and prints mypy's messages with the real file paths
(``workers/entrypoints/llm.py``, not ``.typecheck/batchinfer/workers/llm.py``). Exits with mypy's status.

Usage: ``python .ci/typecheck.py [MYPY_ARGS...]`` from anywhere; ``make lint`` runs it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: mypy itself depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / ".typecheck"
TOP = "batchinfer"
# "path:line: severity: ..." (and "path: error: ..." for whole-file messages).
MESSAGE = re.compile(r"^(?P<path>[^:\s][^:]*\.pyi?)(?P<rest>:.*)$")


def package_dirs() -> dict[str, str]:
    """pyproject's ``[tool.setuptools.package-dir]``: import name -> folder (relative to the root)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return dict(config["tool"]["setuptools"]["package-dir"])


def build_tree(mapping: dict[str, str], tree: Path = TREE) -> Path:
    """Lay out ``tree/batchinfer/`` like the installed package, by symlinks; return ``tree``.

    ``batchinfer/``'s own entries are linked one by one, and every package whose folder is not
    where its name says (``batchinfer.workers`` = ``workers/``) is linked in beside them. Packages
    nested in their parent's folder (``batchinfer.workers.engine`` = ``workers/engine``) come along
    with it. The tree is rebuilt each run so that new and removed modules are always seen."""
    top = tree / TOP
    if top.is_symlink() or top.is_file():
        top.unlink()
    elif top.exists():
        shutil.rmtree(top)
    top.mkdir(parents=True)
    source = ROOT / mapping.get(TOP, TOP)
    moved: dict[str, Path] = {}
    for name, folder in mapping.items():
        if name == TOP:
            continue
        parent, _, leaf = name.rpartition(".")
        if Path(mapping.get(parent, parent.replace(".", "/")), leaf) == Path(folder):
            continue  # nested where its name says: its parent's link covers it
        if parent != TOP:
            raise SystemExit(f"typecheck: {name} = {folder!r}: only {TOP}.X may live in another folder")
        moved[leaf] = ROOT / folder
    for entry in sorted(source.iterdir()):
        if entry.name not in moved and entry.name != "__pycache__":
            (top / entry.name).symlink_to(os.path.relpath(entry, top))
    for leaf, folder in sorted(moved.items()):
        (top / leaf).symlink_to(os.path.relpath(folder, top))
    return tree


def real_path(line: str) -> str:
    """The message with its tree path replaced by the real file's path, relative to the root."""
    match = MESSAGE.match(line)
    if match is None:
        return line
    path = Path(match["path"])
    if not path.is_absolute():
        path = ROOT / path
    if not path.exists():
        return line
    real = path.resolve()
    shown = real.relative_to(ROOT).as_posix() if real.is_relative_to(ROOT) else str(real)
    return shown + match["rest"]


def main(argv: list[str]) -> int:
    build_tree(package_dirs())
    # Run from the root so that pyproject's [tool.mypy] applies and the cache is the root's.
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "-p", TOP, *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in proc.stdout.splitlines():
        print(real_path(line))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
