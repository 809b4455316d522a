"""Load a script of ``bench/`` as a module, for the tests that run a benchmark's small modes."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


@contextmanager
def bench_script(name: str) -> Iterator[ModuleType]:
    """``bench/<name>.py`` loaded as module ``<name>_bench``, registered in ``sys.modules`` while
    in use (dataclasses resolve their annotations through it) and removed after."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]
