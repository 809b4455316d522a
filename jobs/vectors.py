"""Embedding vectors as Parquet columns: widths from the rows' base64 text, the column type, arrays.

A row carries its vectors as base64 of little-endian float32 (docs/protocol.md, ``embeddings``).
A file's ``embedding`` column is ``fixed_size_list<float32>[dim]`` when every vector in it has one
width (DuckDB, polars and Spark read that as an array), else ``list<float32>``. The schema of a
streamed file is fixed before its first row group, so the writer learns the widths first: from a
pass over the rows (:class:`VectorWidths`, fed by the export's sorting pass) or from its first row
group. The bytes go from the base64 text straight into Arrow buffers: bit-exact, no Python floats.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from batchinfer.protocol.rows import decode_vector

#: The vector columns of :func:`batchinfer.jobs.formats.result_schema`, built here, not from records.
VECTOR_FIELDS = ("embedding", "embeddings")
#: The ``embedding`` type when widths differ (per-line ``dimensions``), and in the nightly dataset.
VARIABLE_VECTOR = pa.list_(pa.float32())
_F32 = np.dtype("<f4")


def vector_width(text: str) -> int:
    """The float32 count of one base64 vector, from its length alone (no decoding)."""
    if not isinstance(text, str):
        raise ValueError(f"an embedding must be base64 text, got {type(text).__name__}")
    if len(text) % 4:
        raise ValueError(f"an embedding's base64 text has {len(text)} characters, not a multiple of 4")
    nbytes = len(text) // 4 * 3 - (len(text) - len(text.rstrip("=")))
    if nbytes % 4:
        raise ValueError(f"an embedding of {nbytes} bytes is not a whole number of float32s")
    return nbytes // 4


def vector_type(widths: Iterable[int]) -> pa.DataType | None:
    """``fixed_size_list<float32>[d]`` for one width ``d``, ``list<float32>`` for several, None for none."""
    found = set(widths)
    if not found:
        return None
    if len(found) == 1:
        return pa.list_(pa.float32(), found.pop())
    return VARIABLE_VECTOR


class VectorWidths:
    """The vector widths of rows seen one at a time: what the export learns while it sorts."""

    def __init__(self) -> None:
        self.widths: set[int] = set()

    def add(self, row: Mapping[str, Any]) -> None:
        texts = row.get("embeddings")
        if texts is None:
            return
        if not isinstance(texts, list):
            raise ValueError(f"result row {row.get('request_id')!r}: embeddings must be a list of base64 "
                             f"texts, got {type(texts).__name__}")
        try:
            self.widths.update(vector_width(t) for t in texts)
        except ValueError as e:
            raise ValueError(f"result row {row.get('request_id')!r}: {e}") from None

    @property
    def type(self) -> pa.DataType | None:
        """The ``embedding`` column's type for the rows seen (None: no vectors)."""
        return vector_type(self.widths)


def vector_type_of(rows: Iterable[Mapping[str, Any]]) -> pa.DataType | None:
    """The ``embedding`` column's type for ``rows``."""
    widths = VectorWidths()
    for row in rows:
        widths.add(row)
    return widths.type


def decoded_vectors(row: Mapping[str, Any]) -> list[list[float]] | None:
    """The row's vectors as Python floats (exact: float32 values in float64), None without any."""
    texts = row.get("embeddings")
    return None if texts is None else [decode_vector(t) for t in texts]


def _row_vectors(row: Mapping[str, Any]) -> list[np.ndarray] | None:
    """The row's vectors as float32 arrays ([dim] each), views of the decoded bytes."""
    texts = row.get("embeddings")
    if texts is None:
        return None
    if not isinstance(texts, list):
        raise ValueError(f"embeddings must be a list of base64 texts, got {type(texts).__name__}")
    out = []
    for text in texts:
        raw = base64.b64decode(text, validate=True)
        if len(raw) % 4:
            raise ValueError(f"an embedding of {len(raw)} bytes is not a whole number of float32s")
        out.append(np.frombuffer(raw, dtype=_F32))
    return out


def vector_arrays(rows: Sequence[Mapping[str, Any]], vector: pa.DataType) -> tuple[pa.Array, pa.Array]:
    """The ``embedding`` (type ``vector``) and ``embeddings`` (``list<vector>``) columns of ``rows``.

    ``embedding``: each row's first vector, null for rows without vectors. ``embeddings``: every
    vector of a row that has more than one, else null. A vector whose width a fixed-size
    ``vector`` cannot hold raises naming the row.
    """
    fixed = vector.list_size if isinstance(vector, pa.FixedSizeListType) else None
    firsts: list[np.ndarray | None] = []
    groups: list[list[np.ndarray] | None] = []
    for row in rows:
        try:
            vecs = _row_vectors(row)
        except (ValueError, TypeError, binascii.Error) as e:
            raise ValueError(f"result row {row.get('request_id')!r}: embeddings: {e}") from None
        for v in vecs or ():
            if fixed is not None and len(v) != fixed:
                raise ValueError(f"result row {row.get('request_id')!r} has a {len(v)}-wide embedding in a "
                                 f"file of {fixed}-wide ones (pass the list<float32> type for mixed widths)")
        firsts.append(vecs[0] if vecs else None)
        groups.append(vecs if vecs and len(vecs) > 1 else None)
    inner = _vector_array([v for vs in groups if vs for v in vs], vector)
    lengths = np.array([len(vs) if vs else 0 for vs in groups], dtype=np.int64)
    embeddings = _list_array(lengths, [vs is None for vs in groups], inner, pa.list_(vector))
    return _vector_array(firsts, vector), embeddings


def _validity(nulls: list[bool]) -> pa.Buffer | None:
    """An Arrow validity bitmap (bit set = valid, least significant bit first); None when none is null."""
    if not any(nulls):
        return None
    return pa.py_buffer(np.packbits(~np.array(nulls, dtype=bool), bitorder="little").tobytes())


def _vector_array(vecs: list[np.ndarray | None], vector: pa.DataType) -> pa.Array:
    """Vectors (None: null) as one array of type ``vector``."""
    n, nulls = len(vecs), [v is None for v in vecs]
    if isinstance(vector, pa.FixedSizeListType):
        data = np.zeros((n, vector.list_size), dtype=_F32)  # [n, dim]; a null row's slots stay 0
        for i, v in enumerate(vecs):
            if v is not None:
                data[i] = v
        values = pa.array(data.reshape(-1), type=pa.float32())
        return pa.Array.from_buffers(vector, n, [_validity(nulls)], children=[values])
    present = [v for v in vecs if v is not None]
    flat = np.concatenate(present) if present else np.empty(0, dtype=_F32)  # [sum of widths]
    lengths = np.array([0 if v is None else len(v) for v in vecs], dtype=np.int64)
    return _list_array(lengths, nulls, pa.array(flat, type=pa.float32()), vector)


def _list_array(lengths: np.ndarray, nulls: list[bool], values: pa.Array, list_type: pa.DataType) -> pa.Array:
    """A ``list_type`` array of ``len(lengths)`` lists cut from ``values`` (a null list has length 0)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.Array.from_buffers(list_type, len(lengths), [_validity(nulls), pa.py_buffer(offsets.tobytes())],
                                 children=[values])


def parquet_vector_type(location: str) -> pa.DataType | None:
    """The ``embedding`` column's type of a result file (a path or URI); None when it has none."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    if "://" in location:
        fs, path = pafs.FileSystem.from_uri(location)
        schema = pq.read_schema(path, filesystem=fs)
    else:
        schema = pq.read_schema(location)
    return schema.field("embedding").type if "embedding" in schema.names else None
