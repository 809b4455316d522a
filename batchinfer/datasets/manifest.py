"""Manifests of a partitioned output: which output files a unit of work wrote, from which input rows.

A *unit* is what one job turned into output: the files of one input partition (a nightly run), or
everything one submission read. Its manifest, ``<output root>/_manifests/<unit>.json``, names the
input files (with their sizes: the :func:`fingerprint` a later run compares), the output files written
(paths relative to the output root, their Hive partition, row counts) and, per output file, the input
rows it covers (:class:`InputSpan`). The manifest is written last and atomically (temporary name, then
move), so a reader that trusts manifests never sees a half-written unit; the files an earlier manifest
of the same unit listed and a re-run did not write again are stale, and the exporter deletes them.

Everything here takes a pyarrow filesystem and a path on it, so local folders and object stores
(``s3://``, ``gs://``) behave alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow.fs as pafs

from batchinfer.protocol.entries import valid_job_id

__all__ = ["MANIFEST_DIR", "InputSpan", "Manifest", "OutputFile", "fingerprint", "manifest_path",
           "read_manifest", "read_manifests", "unit_id", "write_manifest"]

log = logging.getLogger(__name__)

MANIFEST_DIR = "_manifests"  # hidden from Hive discovery (a leading '_'), as Spark's _SUCCESS files are
MANIFEST_VERSION = 1
_HEX_DIGITS = 16


def unit_id(parts: Iterable[str]) -> str:
    """A unit's id: the first 16 hex digits of the SHA-256 of ``parts`` joined by newlines (e.g. the
    input root and the sorted relative paths of the unit's files): stable across runs and machines."""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:_HEX_DIGITS]


def fingerprint(files: Iterable[Any]) -> str:
    """What a unit's input looked like: 16 hex digits of the SHA-256 of the sorted ``relative\\tsize``
    lines of ``files`` (objects with ``.relative`` and ``.size``, or dicts with those keys; a size of
    None counts as empty). A file added, removed or rewritten with another size changes it."""
    lines = []
    for f in files:
        relative, size = (f["relative"], f.get("size")) if isinstance(f, Mapping) else (f.relative, f.size)
        lines.append(f"{relative}\t{'' if size is None else size}")
    return hashlib.sha256("\n".join(sorted(lines)).encode()).hexdigest()[:_HEX_DIGITS]


@dataclass
class InputSpan:
    """The rows of one input file that went into an output file: how many, and the first and last
    1-based row numbers within the input file (rows between them may be absent: filtered out, or in
    another output partition)."""

    location: str
    rows: int
    first_row: int
    last_row: int


@dataclass
class OutputFile:
    """One file a unit wrote: ``path`` relative to the output root (``date=2026-12-03/part-<unit>.parquet``),
    its Hive partition (key -> value text, as in the path), its row count and the input rows it covers."""

    path: str
    partition: dict[str, str]
    rows: int
    inputs: list[InputSpan] = field(default_factory=list)


@dataclass
class Manifest:
    """What one unit wrote (see the module's docstring). ``inputs`` are the unit's input files as
    dicts (``location``, ``relative``, ``size``); ``written_at`` is ms since the epoch."""

    unit: str
    fingerprint: str
    job_id: str
    input: str
    inputs: list[dict[str, Any]]
    outputs: list[OutputFile]
    model: str | None
    written_at: int
    version: int = MANIFEST_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse a manifest; ``ValueError`` for anything that is not one of this version."""
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ValueError(f"manifest is not JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("manifest is not a JSON object")
        if d.get("version") != MANIFEST_VERSION:
            raise ValueError(f"manifest version {d.get('version')!r} is not {MANIFEST_VERSION}")
        try:
            outputs = [OutputFile(path=o["path"], partition=dict(o["partition"]), rows=int(o["rows"]),
                                  inputs=[InputSpan(**s) for s in o.get("inputs", [])])
                       for o in d["outputs"]]
            manifest = cls(unit=str(d["unit"]), fingerprint=str(d["fingerprint"]), job_id=str(d["job_id"]),
                           input=str(d["input"]), inputs=list(d["inputs"]), outputs=outputs,
                           model=d.get("model"), written_at=int(d["written_at"]), version=d["version"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"manifest lacks or mistypes a field: {type(e).__name__}: {e}") from None
        if not valid_job_id(manifest.unit):
            raise ValueError(f"manifest unit {manifest.unit!r} is not a valid unit id")
        return manifest


def manifest_path(root_path: str, unit: str) -> str:
    """Where unit ``unit``'s manifest lives below the output root ``root_path`` (a path on its filesystem)."""
    if not valid_job_id(unit):
        raise ValueError(f"unit {unit!r} is invalid (letters, digits, '.', '_', '-'; at most 128)")
    return f"{root_path.rstrip('/')}/{MANIFEST_DIR}/{unit}.json"


def read_manifests(fs: pafs.FileSystem, root_path: str) -> dict[str, Manifest]:
    """Every manifest below ``root_path``, by unit; ``{}`` when there is none (or no root). A manifest
    that cannot be read or parsed is skipped and logged: it names no unit a reader can trust."""
    selector = pafs.FileSelector(f"{root_path.rstrip('/')}/{MANIFEST_DIR}", allow_not_found=True)
    out: dict[str, Manifest] = {}
    for info in sorted(fs.get_file_info(selector), key=lambda i: i.path):
        if info.type != pafs.FileType.File or not info.base_name.endswith(".json") \
                or info.base_name.startswith("."):  # temporary names of manifests being written
            continue
        try:
            with fs.open_input_stream(info.path) as f:
                manifest = Manifest.from_json(f.read())
        except (OSError, ValueError) as e:
            log.warning("skipping manifest %s: %s", info.path, e)
            continue
        out[manifest.unit] = manifest
    return out


def read_manifest(fs: pafs.FileSystem, root_path: str, unit: str) -> Manifest | None:
    """Unit ``unit``'s manifest below ``root_path``; None when there is none or it cannot be read
    (logged, as :func:`read_manifests` does)."""
    path = manifest_path(root_path, unit)
    try:
        with fs.open_input_stream(path) as f:
            return Manifest.from_json(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        if fs.get_file_info(path).type == pafs.FileType.NotFound:
            return None
        log.warning("skipping manifest %s: %s", path, e)
        return None


def write_manifest(fs: pafs.FileSystem, root_path: str, manifest: Manifest) -> str:
    """Write ``manifest`` to :func:`manifest_path` atomically (a hidden temporary name, then a move: a
    rename on local disks, a copy of the complete object on object stores, so a reader sees the old
    manifest or the new one, never part of one); returns its path on ``fs``."""
    path = manifest_path(root_path, manifest.unit)
    folder = path.rsplit("/", 1)[0]
    fs.create_dir(folder, recursive=True)
    tmp = f"{folder}/.{manifest.unit}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        with fs.open_output_stream(tmp) as f:
            f.write(manifest.to_json().encode())
        fs.move(tmp, path)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.delete_file(tmp)
        raise
    return path
