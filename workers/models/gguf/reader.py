"""A GGUF checkpoint opened for reading: which file, its metadata, its tensors (memory-mapped).

``gguf.GGUFReader`` (llama.cpp's own pure-Python reader) parses the file; ``GGUFFile`` adds the
file lookup (a ``.gguf`` path, or a folder holding exactly one), metadata access with errors that
name the key and the file, and a faster parse of the metadata (see ``_FastReader``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, ReaderTensor

SUFFIX = ".gguf"


def gguf_path(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names, or None when it is a Hugging Face folder (no ``.gguf`` in it).

    A file must end in ``.gguf``; a folder without ``config.json`` + safetensors that holds
    ``.gguf`` files must hold exactly one. ``FileNotFoundError`` / ``ValueError`` say what is wrong.
    """
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() != SUFFIX:
            raise ValueError(f"{path}: not a .gguf file (give a .gguf file or a model folder)")
        return path
    if not path.is_dir():
        if path.suffix.lower() == SUFFIX:
            raise FileNotFoundError(f"{path}: GGUF file not found")
        return None
    if any((path / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        return None  # a Hugging Face folder (it may hold a .gguf as well: the safetensors win)
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ValueError(f"{path}: holds {len(found)} .gguf files ({names}); give the file itself")
    return found[0] if found else None


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a GGUF checkpoint (a ``.gguf`` file or a folder holding exactly one)."""
    try:
        return gguf_path(path) is not None
    except (OSError, ValueError):
        return Path(path).suffix.lower() == SUFFIX


class _FastReader(GGUFReader):
    """``GGUFReader`` over a plain ndarray view of its memory map, with a leaner ``_get``.

    The stock reader slices an ``np.memmap`` once per metadata string, and every slice of a
    memmap subclass runs ``__array_finalize__``: a 49k-token vocabulary took 6 s to parse. A
    plain view of the same mapping gives the same arrays (still memory-mapped) in a quarter of that.
    """

    _dtypes: dict[Any, np.dtype] = {}

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)  # .base keeps the mapping alive

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        if self.byte_order != "I" or sys.byteorder != "little" or override_order not in (None, "<"):
            return super()._get(offset, dtype, count, override_order)
        dt = self._dtypes.get(dtype)
        if dt is None:
            dt = self._dtypes[dtype] = np.dtype(dtype)
        return self._plain[offset:offset + dt.itemsize * int(count)].view(dt)


class GGUFFile:
    """One GGUF checkpoint: ``metadata`` (key -> Python value) and ``tensors`` (name -> tensor)."""

    def __init__(self, path: str | Path) -> None:
        found = gguf_path(path)
        if found is None:
            raise FileNotFoundError(f"{path}: no .gguf file in this folder")
        self.path = found
        try:
            # 'c': copy-on-write, so torch can wrap the arrays without a read-only warning; the
            # file itself is never written.
            self.reader = _FastReader(found, "c")
        except (ValueError, KeyError, IndexError) as e:
            raise ValueError(f"{found}: not a readable GGUF file ({e})") from None
        self.tensors: dict[str, ReaderTensor] = {t.name: t for t in self.reader.tensors}
        self._metadata: dict[str, Any] | None = None

    @property
    def metadata(self) -> dict[str, Any]:
        """Every metadata field as a Python value (str, int, float, bool or a list of them)."""
        if self._metadata is None:
            self._metadata = {k: f.contents() for k, f in self.reader.fields.items()}
        return self._metadata

    @property
    def architecture(self) -> str:
        """``general.architecture`` (``llama``, ``qwen2`` ...): the prefix of the model's keys."""
        return str(self.require("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        """One field's value, ``default`` when absent (reads only that field)."""
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        """One field's value; ``ValueError`` naming the key and the file when it is absent."""
        field = self.reader.fields.get(key)
        if field is None:
            raise ValueError(f"{self.path.name}: metadata key {key!r} is missing")
        return field.contents()

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        """``<architecture>.<suffix>``, e.g. ``arch_get("block_count")``."""
        return self.get(f"{self.architecture}.{suffix}", default)

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, {len(self.tensors)} tensors)"
