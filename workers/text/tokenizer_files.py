"""The files a model's tokenizer is made of, read from its folder (or rebuilt from a GGUF file).

A worker registers these bytes with the queue (the scheduler tokenises and renders chats with
them); the engine's ``tokenizer_files()`` reports them. The registry only stores bytes.
"""

from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json", "chat_template.jinja")


def read_tokenizer_files(model_dir: str | Path) -> dict[str, bytes]:
    """The :data:`TOKENIZER_FILES` of a model folder, as a worker registers them (tokenizer.json required).

    A GGUF checkpoint (a ``.gguf`` file, or a folder holding one and no tokenizer.json) has its
    files rebuilt from its metadata (``batchinfer.workers.models.gguf.tokenizer``)."""
    path = Path(model_dir)
    if not (path / "tokenizer.json").is_file() and (
            path.suffix.lower() == ".gguf" or (path.is_dir() and any(path.glob("*.gguf")))):
        # imported here: only a worker serving a GGUF needs the gguf package (and numpy, torch)
        from batchinfer.workers.models.gguf.tokenizer import tokenizer_files

        return tokenizer_files(path)
    files = {name: (path / name).read_bytes() for name in TOKENIZER_FILES if (path / name).is_file()}
    if "tokenizer.json" not in files:
        raise FileNotFoundError(f"{path / 'tokenizer.json'}: not found (only fast tokenizers are supported)")
    return files
