"""Result files the CLI writes (``results -o``, ``run -o``): the format from the name, no overwrite.

The format comes from the file name unless ``--format`` says it: ``.parquet`` / ``.pq`` is Parquet,
``.jsonl`` / ``.ndjson`` the rows' JSON lines; OpenAI batch output lines and Anthropic result
lines (also JSONL) only with ``--format openai`` / ``--format anthropic``. A name that says neither,
or a compressed one (``.gz``: nothing here writes compressed files), is refused rather than guessed.
An existing file is kept unless ``--force``. ``--error-file`` is written in the output's format.
"""

from __future__ import annotations

import os

import click

_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zstd")


def output_format(location: str, fmt: str | None, param_hint: str = "-o") -> str:
    """``fmt`` when given, else the format ``location``'s extension names; ``click.BadParameter``
    (exit 2) when it names none."""
    name = location.rstrip("/").rsplit("/", 1)[-1].lower()
    if fmt is not None:
        if name.endswith(COMPRESSED):
            raise click.BadParameter(f"{location}: compressed output is not written; write "
                                     f"{location.rsplit('.', 1)[0]} and compress it", param_hint=param_hint)
        return fmt
    for suffix in COMPRESSED:
        if name.endswith(suffix):
            raise click.BadParameter(f"{location}: compressed output is not written; write "
                                     f"{location[:-len(suffix)]} and compress it", param_hint=param_hint)
    ext = os.path.splitext(name)[1]
    if ext not in _SUFFIXES:
        raise click.BadParameter(f"{location}: cannot tell the format from the name (.parquet, .jsonl); "
                                 "pass --format parquet|jsonl|openai|anthropic", param_hint=param_hint)
    return _SUFFIXES[ext]


def exists(location: str) -> bool:
    """Whether a file is at ``location`` (a path, ``file://`` or a pyarrow URI); False when a remote
    filesystem cannot tell (the write then reports its own error)."""
    if "://" not in location:
        return os.path.lexists(location)
    try:
        from pyarrow import fs

        filesystem, path = fs.FileSystem.from_uri(location)
        return filesystem.get_file_info(path).type != fs.FileType.NotFound
    except Exception:  # no credentials, no network, an unknown scheme: do not block the write on it
        return False


def refuse_overwrite(location: str, force: bool) -> None:
    """Exit 2 with a message when a file is at ``location`` and ``force`` is not set."""
    if not force and exists(location):
        from batchinfer.cli.context import EXIT_USAGE, fail

        fail(EXIT_USAGE, f"{location} exists: pass --force to overwrite it, or choose another -o")


def check_error_file(error_file: str | None, output: str, fmt: str, force: bool) -> None:
    """``--error-file``: not OUTPUT itself, not compressed, and not an existing file unless ``force``
    (exit 2, before anything is written)."""
    if error_file is None:
        return
    if _same_place(error_file, output):
        raise click.BadParameter(f"{error_file}: the error file must not be OUTPUT itself",
                                 param_hint="--error-file")
    output_format(error_file, fmt, param_hint="--error-file")  # with fmt given: refuses compression only
    if not force and exists(error_file):
        from batchinfer.cli.context import EXIT_USAGE, fail

        fail(EXIT_USAGE, f"{error_file} exists: pass --force to overwrite it, or choose another --error-file")


def _same_place(a: str, b: str) -> bool:
    def place(location: str) -> str:
        if location.startswith("file://"):
            location = location[len("file://"):]
        return location if "://" in location else os.path.realpath(location)

    return place(a) == place(b)
