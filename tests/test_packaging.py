"""The explicit package list in pyproject.toml covers every package folder."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from batchinfer.cli.runner import python_module

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


OUR_KERNELS = ROOT / "kernels" / "__init__.py"
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed")


def _env() -> dict[str, str]:
    """This environment without what would put folders on sys.path behind the command's back."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}


def _make_test_command() -> list[str]:
    """The pytest line of the Makefile's `test:` recipe as this venv runs it, with no PYTEST_ARGS."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    steps: list[str] = []
    for line in lines[lines.index("test: setup-dev") + 1:]:
        if not line.startswith("\t"):
            break
        steps.append(line)
    (recipe,) = [line for line in steps if "/pytest " in line]
    bin_dir = str(Path(sys.executable).parent)
    return shlex.split(recipe.strip().replace("$(BIN)", bin_dir).replace("$(PYTEST_ARGS)", ""))


@needs_transformers
def test_make_test_collects_the_suite_with_the_real_kernels_package_installed():
    """`make test`'s own command, from the repository root, collects every test module.

    transformers 5 imports the Hugging Face `kernels` package when it is installed (the lock
    installs it: transformers depends on it); a command that puts the root first on sys.path
    (`python -m pytest`) imports our kernels/ folder in its place and collection stops with
    `cannot import name 'CUDAProperties' from 'kernels'` in every module that imports transformers.
    """
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the Hugging Face kernels package is not installed: nothing to shadow")
    command = [*_make_test_command(), "--collect-only", "-p", "no:cacheprovider"]
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    # "N tests collected in S s" with no ", M errors" (a module that failed to import).
    assert re.search(r"^\d+ tests collected in ", done.stdout, re.M), tail


@pytest.mark.skipif(sys.version_info < (3, 11), reason="python -P is new in 3.11")
@needs_transformers
def test_python_dash_p_in_the_repo_root_imports_transformers_past_our_kernels_folder():
    """README's way around: our kernels/ shadows the `kernels` package transformers 5 probes for."""

    def run(*flags: str, code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=300)

    # Without -P the current directory comes first, and `kernels` is our folder: why README says so.
    plain = run(code="import importlib.util; print(importlib.util.find_spec('kernels').origin)")
    assert plain.returncode == 0 and plain.stdout.strip() == str(OUR_KERNELS), plain
    # With -P transformers imports the real package (site-packages: inside the repository when
    # .venv is), or none where it is not installed; never our folder.
    safe = run("-P", code="import sys, transformers.modeling_utils\n"
                          "k = sys.modules.get('kernels')\n"
                          "print(k.__file__ if k else '')")
    assert safe.returncode == 0, safe.stderr[-3000:]
    origin = safe.stdout.strip().splitlines()[-1] if safe.stdout.strip() else ""
    assert origin != str(OUR_KERNELS), origin
    try:
        real = importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py")
    except importlib.metadata.PackageNotFoundError:
        return  # transformers < 5 or without it: nothing to import
    assert origin == str(real), origin


def test_daemon_children_start_past_our_kernels_folder(tmp_path):
    """`batchinfer run`'s daemons (python_module) started in the checkout do not see kernels/ as
    `kernels`; a plain `python -m` does, which is what python_module exists to avoid."""
    (tmp_path / "probe_kernels.py").write_text(
        "import importlib.util\nspec = importlib.util.find_spec('kernels')\n"
        "print(spec.origin if spec else '')\n")
    env = {**_env(), "PYTHONPATH": str(tmp_path)}

    def origin(command: list[str]) -> str:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip()

    assert origin([sys.executable, "-m", "probe_kernels"]) == str(OUR_KERNELS)
    if sys.version_info >= (3, 11):
        assert origin(python_module("probe_kernels")) != str(OUR_KERNELS)


# `python -m X` / `python -c` without -P, in the project's commands; pip and venv import nothing of ours.
UNSAFE_START = re.compile(r"""\bpython3?["',\s]+-[mc]\b(?![\s"',]+(pip|venv)\b)""")
COMMAND_FILES = ["Makefile", "README.md", "docker-compose.yml", "Dockerfile", ".ci/run", "bench/*.sh",
                 "docs/*.md", "deploy/**/*"]


def test_every_documented_command_starts_python_past_our_kernels_folder():
    """Makefile recipes, scripts, compose health checks and the docs' commands run in the checkout
    (or the image's /app, which holds kernels/ too): each starts Python with -P, as a script, or
    through an entry point; daemons started from code go through python_module."""
    offenders = []
    for pattern in COMMAND_FILES:
        for path in sorted(ROOT.glob(pattern)):
            if not path.is_file():
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if UNSAFE_START.search(line) and "kernels/" not in line and "not `python -m" not in line:
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    for folder in ("batchinfer", "workers", "jobs", "kernels", "bench", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"""sys\.executable,\s*["']-m["'],\s*["']batchinfer""", line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "start these with -P (python_module in code):\n" + "\n".join(offenders)
