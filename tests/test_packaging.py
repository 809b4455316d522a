"""The explicit package list in pyproject.toml covers every package folder."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    folders = {v: k for k, v in config["package-dir"].items()}
    found = set()
    for top in folders:
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).as_posix()
            # The deepest package-dir entry that contains this folder gives its import name.
            base = max((f for f in folders if rel == f or rel.startswith(f + "/")), key=len)
            name = folders[base] + rel[len(base):].replace("/", ".")
            found.add(name)
    assert found, "no package folders found"
    unlisted, missing = sorted(found - listed), sorted(listed - found)
    assert found == listed, f"unlisted: {unlisted}, listed but missing: {missing}"


def test_import_names_resolve():
    import batchinfer
    import batchinfer.jobs
    import batchinfer.kernels
    import batchinfer.workers

    assert Path(batchinfer.workers.__file__).parent.name == "workers"
    assert Path(batchinfer.kernels.__file__).parent.name == "kernels"
    assert Path(batchinfer.jobs.__file__).parent.name == "jobs"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="python -P is new in 3.11")
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_python_dash_p_in_the_repo_root_imports_transformers_past_our_kernels_folder():
    """README's way around: our kernels/ shadows the `kernels` package transformers 5 probes for."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}

    def run(*flags: str, code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *flags, "-c", code, str(ROOT)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)

    # Without -P the current directory comes first, and `kernels` is our folder: why README says so.
    plain = run(code="import importlib.util; print(importlib.util.find_spec('kernels').origin)")
    assert plain.returncode == 0 and plain.stdout.strip() == str(ROOT / "kernels" / "__init__.py"), plain
    safe = run("-P", code="import sys, transformers.modeling_utils\n"
                          "k = sys.modules.get('kernels')\n"
                          "assert k is None or not k.__file__.startswith(sys.argv[1]), k.__file__")
    assert safe.returncode == 0, safe.stderr[-3000:]
