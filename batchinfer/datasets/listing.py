"""Finding a file-based dataset's files: a folder, a glob, a list, one file, or a pyarrow FileSystemDataset.

A :class:`Listing` holds the files (sorted by location), their Hive partitions read from the paths,
the format, and the pyarrow dataset over exactly those files (built on first need: inspecting the
schema reads one file). Formats come from suffixes (``.parquet`` ``.pq`` / ``.csv`` / ``.jsonl``
``.json`` ``.ndjson``; CSV and JSON also compressed: ``.gz`` ``.bz2`` ``.zst`` ``.lz4``) unless one is
given; then a folder's files without any suffix (Hive's ``000000_0``) are read too. Files and folders
whose name starts with ``.`` or ``_`` are never data (``_manifests/``, ``_SUCCESS``, ``.crc`` files),
as pyarrow and Spark treat them. Every failure is an :class:`InputError` with one sentence.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs

from batchinfer.datasets.errors import InputError  # pyarrow-free: the CLI maps it on every command
from batchinfer.datasets.uris import filesystem_for, is_uri, location_of, store_error

FORMATS = ("parquet", "csv", "json")
_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "json", ".json": "json",
             ".ndjson": "json"}
_COMPRESSIONS = (".gz", ".bz2", ".zst", ".lz4")  # pyarrow's CSV / JSON readers decompress these
_URI_OPTIONS = re.compile(r"\?[A-Za-z_]+=")  # pyarrow's URI options (s3://b/k?region=x), not a wildcard
_FORMAT_HINT = f"give format= ({', '.join(FORMATS)})"


@dataclass(frozen=True)
class DatasetFile:
    """One file of a dataset (or the one pseudo file of data in memory)."""

    location: str  # URI or absolute path (errors, manifests)
    relative: str  # path below the dataset root ("date=2026-12-03/part-0.parquet"); in memory: the name
    size: int | None  # bytes; None for in-memory data
    partition: dict[str, str]  # Hive key -> value text from the path ({"date": "2026-12-03"}); {} when none

    def __hash__(self) -> int:  # the dict field is not hashable; the location names the file
        return hash(self.location)


def format_of(name: str) -> str | None:
    """The format a file name's suffix says (parquet | csv | json), or None."""
    lower = name.lower()
    compression = next((c for c in _COMPRESSIONS if lower.endswith(c)), "")
    found = _SUFFIXES.get(posixpath.splitext(lower[:len(lower) - len(compression)])[1])
    return None if compression and found == "parquet" else found


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def unreadable(location: str, fmt: str | None, e: BaseException) -> str:
    """The sentence for a file pyarrow cannot read as its format."""
    return f"{location} is not a readable {fmt} file: {_first_line(e)}"


def _hidden(relative: str) -> bool:
    return any(part.startswith((".", "_")) for part in relative.split("/"))


def _hive(relative: str) -> dict[str, str]:
    """The ``key=value`` folders of a relative path (percent-decoded, as pyarrow reads them)."""
    pairs = (part.partition("=") for part in relative.split("/")[:-1])
    return {unquote(k): unquote(v) for k, sep, v in pairs if sep and k}


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A glob as a regex over relative paths: ``**`` spans folders, ``*`` ``?`` ``[...]`` stay in one."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] in "*?":
            out.append("[^/]*" if pattern[i] == "*" else "[^/]")
            i += 1
        elif pattern[i] == "[" and (end := pattern.find("]", i + 2)) > 0:
            body = pattern[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body).replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def is_glob(text: str) -> bool:
    """Whether ``text`` has a wildcard (``*`` ``?`` ``[``) outside a URI's option query."""
    body = _URI_OPTIONS.split(text, 1)[0] if is_uri(text) else text
    return any(c in body for c in "*?[")


def _below(path: str, root: str) -> str:
    prefix = root.rstrip("/") + "/"
    return path[len(prefix):] if path.startswith(prefix) else path


@dataclass
class Listing:
    """A file-based source's files (sorted by location) and where they live."""

    fs: pafs.FileSystem
    root_path: str
    name: str
    files: list[DatasetFile]
    paths: dict[str, str]  # location -> path on fs
    format: str
    keys: list[str]  # Hive keys in path order
    dataset: ds.FileSystemDataset | None = None  # see :meth:`pyarrow_dataset`

    @property
    def root(self) -> str:
        return location_of(self.fs, self.root_path)

    def pyarrow_dataset(self) -> ds.FileSystemDataset:
        """A pyarrow dataset over exactly these files, Hive partitions typed by pyarrow's discovery
        (``year=2026`` int32, ``date=2026-12-03`` string); built once (it reads the first file's schema)."""
        if self.dataset is None:
            paths = [self.paths[f.location] for f in self.files]
            fmt = {"parquet": ds.ParquetFileFormat, "csv": ds.CsvFileFormat, "json": ds.JsonFileFormat}
            try:
                self.dataset = ds.dataset(paths, filesystem=self.fs, format=fmt[self.format](),
                                          partitioning="hive" if self.keys else None,
                                          partition_base_dir=self.root_path)
            except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
                raise InputError(unreadable(self.files[0].location, self.format, e)) from None
            except OSError as e:
                raise InputError(store_error(e, self.files[0].location)) from None
        return self.dataset


_Entry = tuple[str, str, int | None, dict[str, str]]  # path, relative, size, partition


def _make(fs: pafs.FileSystem, root: str, name: str, entries: list[_Entry], fmt: str) -> Listing:
    """A listing of ``(path, relative, size, partition)`` entries."""
    pairs = sorted(((DatasetFile(location_of(fs, path), rel, size, part), path)
                    for path, rel, size, part in entries), key=lambda pair: pair[0].location)
    keys = list(dict.fromkeys(k for f, _ in pairs for k in f.partition))
    return Listing(fs, root, name, [f for f, _ in pairs], {f.location: p for f, p in pairs}, fmt, keys)


def _filesystem(location: str) -> tuple[pafs.FileSystem, str]:
    try:
        return filesystem_for(location)
    except ValueError as e:
        raise InputError(str(e)) from None


def _name(fs: pafs.FileSystem, root: str) -> str:
    return posixpath.basename(root.rstrip("/")) or location_of(fs, root)


def explain(fs: pafs.FileSystem, path: str, location: str, error: OSError | None) -> str:
    """Why ``path`` cannot be read (``error``: what a HEAD raised; None: it found nothing). An object
    store answers a refused HEAD without a body and a missing bucket's HEAD as not found, so a listing
    asks again: its error names a missing bucket or the credentials' fault."""
    if isinstance(fs, pafs.LocalFileSystem):
        return store_error(error, location) if error else f"no such file or folder: {location}"
    if error is not None and "ACCESS_DENIED" not in str(error):
        return store_error(error, location)
    try:
        fs.get_file_info(pafs.FileSelector(path, recursive=False))
    except OSError as e:
        return store_error(e, location)
    return store_error(error, location) if error else f"{location} does not exist"


def list_location(text: str, fmt: str | None) -> Listing:
    """One file, or a folder (all of it, Hive partitions discovered)."""
    fs, path = _filesystem(text)
    location = location_of(fs, path)
    try:
        info = fs.get_file_info(path)
    except OSError as e:
        raise InputError(explain(fs, path, location, e)) from None
    if info.type == pafs.FileType.NotFound:
        raise InputError(explain(fs, path, location, None))
    if info.type == pafs.FileType.Directory:
        return _list_folder(fs, path, None, _name(fs, path), fmt, location)
    fmt = fmt or format_of(info.base_name)
    if fmt is None:
        raise InputError(f"cannot tell the format of {location} from its name: {_FORMAT_HINT}")
    file = DatasetFile(location, info.base_name, info.size, {})
    return Listing(fs, posixpath.dirname(path), info.base_name, [file], {location: path}, fmt, [])


def list_glob(text: str, fmt: str | None) -> Listing:
    """The files a glob matches below its fixed prefix (the root: Hive partitions below it discovered)."""
    body = _URI_OPTIONS.split(text, 1)[0] if is_uri(text) else text
    first = min(body.index(c) for c in "*?[" if c in body)
    cut = body.rfind("/", 0, first)
    prefix = body[:cut] if cut > 0 else ("/" if cut == 0 else ".")
    if prefix.endswith(":/"):
        raise InputError(f"{text}: a glob needs a fixed bucket or folder before its first wildcard")
    fs, path = _filesystem(prefix + text[len(body):])
    return _list_folder(fs, path, glob_regex(body[cut + 1:]), _name(fs, path), fmt, text)


def _list_folder(fs: pafs.FileSystem, root: str, pattern: re.Pattern[str] | None, name: str,
                 fmt: str | None, shown: str) -> Listing:
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    except OSError as e:
        raise InputError(store_error(e, location_of(fs, root))) from None
    found = [(_below(i.path, root), i) for i in infos if i.type == pafs.FileType.File]
    found = [(rel, i) for rel, i in found if not _hidden(rel) and (pattern is None or pattern.match(rel))]
    if not found:
        # an empty folder is a likely slip (a wrong path, a partition not there yet): say what one holds
        raise InputError(f"{shown} matches no file" if pattern else
                         f"{shown} holds no file: a dataset folder holds Parquet, CSV or JSON-lines files "
                         "(names starting with '.' or '_' are not read)")
    given = fmt
    if fmt is None:
        formats = sorted({f for rel, _ in found if (f := format_of(rel)) is not None})
        if len(formats) != 1:
            what = "mixes " + " and ".join(formats) if formats else "holds no Parquet, CSV or JSON-lines file"
            raise InputError(f"{shown} {what}: {_FORMAT_HINT}")
        fmt = formats[0]
    kept = [(rel, i) for rel, i in found if format_of(rel) == fmt
            or (given and not posixpath.splitext(posixpath.basename(rel))[1])]
    if not kept:
        raise InputError(f"{shown} holds no {fmt} file")
    return _make(fs, root, name, [(i.path, rel, i.size, _hive(rel)) for rel, i in kept], fmt)


def list_files(items: list[str], fmt: str | None) -> Listing:
    """Exactly these files; the root is their common folder (Hive partitions below it discovered)."""
    if not items:
        raise InputError("an empty list of files")
    resolved = [_filesystem(x) for x in dict.fromkeys(items)]
    fs = resolved[0][0]
    if any(other.type_name != fs.type_name for other, _ in resolved):
        raise InputError("the files of one list must be on one file system")
    paths = [p for _, p in resolved]
    try:
        infos = fs.get_file_info(paths)
    except OSError as e:
        raise InputError(store_error(e, location_of(fs, paths[0]))) from None
    for info in infos:
        location = location_of(fs, info.path)
        if info.type == pafs.FileType.NotFound:
            raise InputError(explain(fs, info.path, location, None))
        if info.type != pafs.FileType.File:
            raise InputError(f"{location} is a folder: give a folder alone, or the files in it")
    try:
        root = posixpath.commonpath([posixpath.dirname(p) for p in paths])
    except ValueError:
        root = ""
    if fmt is None:
        odd = next((p for p in paths if format_of(p) is None), None)
        if odd is not None:
            raise InputError(f"cannot tell the format of {location_of(fs, odd)}: {_FORMAT_HINT}")
        formats = {f for p in paths if (f := format_of(p)) is not None}
        if len(formats) > 1:
            raise InputError(f"the files mix {' and '.join(sorted(formats))}: {_FORMAT_HINT}")
        fmt = formats.pop()
    entries: list[_Entry] = [(i.path, _below(i.path, root), i.size, _hive(_below(i.path, root)))
                             for i in infos]
    return _make(fs, root, _name(fs, root), entries, fmt)


def list_pyarrow(dataset: ds.FileSystemDataset) -> Listing:
    """A pyarrow FileSystemDataset's own files, format and partitioning (any flavour)."""
    fs, paths = dataset.filesystem, list(dataset.files)
    if not paths:
        raise InputError("the pyarrow dataset holds no file")
    try:
        sizes = {i.path: i.size for i in fs.get_file_info(paths)}
    except OSError as e:
        raise InputError(store_error(e, location_of(fs, paths[0]))) from None
    root = posixpath.commonpath([posixpath.dirname(p) for p in paths])
    partitions = {f.path: {k: str(v) for k, v in ds.get_partition_keys(f.partition_expression).items()}
                  for f in dataset.get_fragments()}
    entries: list[_Entry] = [(p, _below(p, root), sizes.get(p), partitions.get(p, {})) for p in paths]
    fmt = dataset.format.default_extname
    listing = _make(fs, root, _name(fs, root), entries, fmt if fmt in FORMATS else "parquet")
    if dataset.partitioning is not None:
        listing.keys = list(dataset.partitioning.schema.names)
    listing.dataset = dataset
    return listing
