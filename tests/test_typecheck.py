""".ci/typecheck.py: mypy sees the package as installed (folders mapped by package-dir)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("typecheck", ROOT / ".ci" / "typecheck.py")
assert _spec is not None and _spec.loader is not None
typecheck = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(typecheck)


def test_tree_maps_every_import_name_to_its_folder(tmp_path: Path) -> None:
    mapping = typecheck.package_dirs()
    tree = typecheck.build_tree(mapping, tmp_path)
    for name, folder in mapping.items():
        if name == "batchinfer":
            continue  # a folder of links, checked below
        linked = tree / name.replace(".", "/")
        assert linked.resolve() == (ROOT / folder).resolve(), name
    assert (tree / "batchinfer" / "keys.py").resolve() == ROOT / "batchinfer" / "keys.py"
    assert not (tree / "batchinfer" / "__pycache__").exists()


def test_rebuilding_drops_a_stale_entry(tmp_path: Path) -> None:
    tree = typecheck.build_tree(typecheck.package_dirs(), tmp_path)
    (tree / "batchinfer" / "gone.py").symlink_to(ROOT / "batchinfer" / "keys.py")
    typecheck.build_tree(typecheck.package_dirs(), tmp_path)
    assert not (tree / "batchinfer" / "gone.py").exists()
    assert (ROOT / "batchinfer" / "keys.py").exists()  # removing the link left its target alone


def test_messages_name_the_real_files(tmp_path: Path) -> None:
    tree = typecheck.build_tree(typecheck.package_dirs(), tmp_path)
    line = f"{tree}/batchinfer/workers/text/stopping.py:12: error: boom  [misc]"
    assert typecheck.real_path(line) == "workers/text/stopping.py:12: error: boom  [misc]"
    line = f"{tree}/batchinfer/keys.py:3: note: see"
    assert typecheck.real_path(line) == "batchinfer/keys.py:3: note: see"
    assert typecheck.real_path("Found 2 errors in 1 file") == "Found 2 errors in 1 file"


def test_a_wrong_call_into_a_mapped_folder_is_reported(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    tree = typecheck.build_tree(typecheck.package_dirs(), tmp_path / "tree")
    # A module of the package itself (batchinfer.probe) calling into workers/ (batchinfer.workers)
    # and kernels/: if the tree did not resolve those imports, mypy would say import-not-found and
    # could not see the wrong argument types.
    (tree / "batchinfer" / "probe.py").write_text(
        "from batchinfer.kernels.attention_config import AttentionConfig\n"
        "from batchinfer.workers.sampling_params import SamplingParams\n"
        "\n"
        "SamplingParams(n=2)\n"
        "SamplingParams(n='two')\n"
        "reveal_type(AttentionConfig)\n"
    )
    env = {**os.environ, "MYPYPATH": str(tree)}  # searched before [tool.mypy]'s mypy_path
    # The root's cache (warm after `make lint`): torch's stubs alone take half a minute cold.
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=silent", "-m", "batchinfer.probe"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, out.stdout + out.stderr
    assert 'probe.py:5: error: Argument "n" to "SamplingParams" has incompatible type "str"' in errors[0]
    assert "batchinfer.kernels.attention_config.AttentionConfig" in out.stdout
