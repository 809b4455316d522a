"""The explicit package list in pyproject.toml covers every package folder."""

from __future__ import annotations

from pathlib import Path

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
