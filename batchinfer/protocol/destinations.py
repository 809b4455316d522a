"""Where a job's results may be written: the one rule the client, the scheduler and the exporter apply.

A job's ``output`` is named by whoever submitted the job — possibly a service that XADDs raw
``op open`` entries as the restricted ``producer`` ACL user — while the exporter writes it with its
own rights and cloud credentials. So a producer may name only destinations the operator set up:

- a path inside ``BATCHINFER_RESULTS_ROOT`` (a relative path is taken below it; ``..``, absolute
  paths elsewhere and symlinks out of it are refused), or the ``file://`` URI of such a path;
- a URI under one of ``BATCHINFER_OUTPUT_URI_PREFIXES`` (comma-separated, none by default), at a
  path boundary: ``s3://bucket/out`` allows ``s3://bucket/out/x.parquet``, not
  ``s3://bucket/outside`` nor ``s3://bucket.evil/``. Such a URI has no ``..`` segment (percent-encoded
  either), no query string (pyarrow takes ``endpoint_override``, ``scheme`` and keys from it), no
  fragment and no ``user:password@``: endpoints and credentials are the exporter's environment's
  (``AWS_ENDPOINT_URL``, ...), never the producer's.

Pure checks, no I/O beyond resolving local symlinks: cheap enough for the scheduler's intake.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from urllib.parse import unquote, urlsplit

PREFIXES_VARIABLE = "BATCHINFER_OUTPUT_URI_PREFIXES"
ROOT_VARIABLE = "BATCHINFER_RESULTS_ROOT"
MAX_OUTPUT_CHARS = 4096
_SHOWN_CHARS = 200  # of an output quoted in an error


def check_output(output: object, results_root: str, uri_prefixes: str | Iterable[str] = ()) -> str:
    """``output`` when a producer may name it as a job's destination; else ``ValueError`` saying why.

    ``uri_prefixes``: the allow-list, as the setting's comma-separated text or a list.
    """
    if not isinstance(output, str) or not output.strip():
        raise ValueError(f"output must be a path or URI, got {output!r}")
    if len(output) > MAX_OUTPUT_CHARS:
        raise ValueError(f"output is {len(output)} characters long; the limit is {MAX_OUTPUT_CHARS}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in output):
        raise ValueError(f"output {_shown(output)} contains a control character")
    root = os.path.realpath(results_root)
    if "://" not in output:
        if not _inside(os.path.join(root, output), root):  # an absolute output replaces root here
            raise ValueError(f"output {_shown(output)} is outside the results folder {root} "
                             f"({ROOT_VARIABLE}): give a path below it, or a URI under {PREFIXES_VARIABLE}")
        return output
    problem = _uri_problem(output)
    if problem:
        raise ValueError(f"output {_shown(output)}: {problem}")
    allowed = parse_prefixes(uri_prefixes)
    prefix = next((p for p in allowed if _under(output, p)), None)
    if _scheme(output) == "file":
        path = _file_path(output)
        base = root if prefix is None else _file_path(prefix)
        if path is not None and base is not None and _inside(path, base):
            return output
        if prefix is not None:
            raise ValueError(f"output {_shown(output)} leaves {prefix} (a symlink out of it, or not a "
                             "local path)")
    elif prefix is not None:
        return output
    listed = ", ".join(allowed) if allowed else "none are set"
    raise ValueError(f"output {_shown(output)} is not an allowed destination: a producer may name a path "
                     f"inside the results folder {root} ({ROOT_VARIABLE}) or a URI under one of "
                     f"{PREFIXES_VARIABLE} ({listed})")


def parse_prefixes(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """The allow-list from the setting's comma-separated text (or a list); ``ValueError`` naming
    the setting for an entry that is not a plain ``scheme://...`` prefix."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    out = []
    for item in items:
        prefix = item.strip()
        if not prefix:
            continue
        problem = _uri_problem(prefix) if "://" in prefix else "no scheme:// (file:///path for a folder)"
        if problem:
            raise ValueError(f"{PREFIXES_VARIABLE}: {_shown(prefix)} is not a URI prefix: {problem}")
        out.append(prefix)
    return tuple(out)


def _uri_problem(uri: str) -> str | None:
    """What makes ``uri`` one a producer may not give, whatever the allow-list; None when nothing."""
    if "?" in uri:
        return "a query string is not allowed (endpoints, schemes and credentials are the operator's)"
    if "#" in uri:
        return "a fragment ('#') is not allowed"
    try:
        parts = urlsplit(uri)
    except ValueError as e:
        return f"not a valid URI ({e})"
    if not parts.scheme:
        return "not a valid URI (no scheme)"
    if "@" in parts.netloc:
        return "credentials (user:password@) are not allowed in a URI"
    if ".." in unquote(parts.path).split("/") or ".." in unquote(parts.netloc).split("/"):
        return "'..' path segments are not allowed"
    return None


def _scheme(uri: str) -> str:
    return uri.split("://", 1)[0].lower()


def _under(uri: str, prefix: str) -> bool:
    """Whether ``uri`` is ``prefix`` or below it at a path boundary (the scheme compared case-blind)."""
    uri, prefix = _normal(uri), _normal(prefix)
    return uri == prefix or uri.startswith(prefix if prefix.endswith("/") else prefix + "/")


def _normal(uri: str) -> str:
    scheme, rest = uri.split("://", 1)
    return f"{scheme.lower()}://{rest}"


def _file_path(uri: str) -> str | None:
    """The local path of a ``file:///path`` URI (percent-decoded, as pyarrow reads it); None for
    ``file://host/...``, which names another machine."""
    parts = urlsplit(uri)
    if parts.netloc:
        return None
    return unquote(parts.path) or "/"


def _inside(path: str, root: str) -> bool:
    """Whether ``path``, symlinks resolved, is ``root`` (symlinks resolved) or below it."""
    path, root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([root, path]) == root


def _shown(output: str) -> str:
    """``output`` as an error quotes it: any ``user:password@`` hidden, long values cut."""
    if "://" in output:
        scheme, rest = output.split("://", 1)
        host, sep, path = rest.partition("/")
        if "@" in host:
            output = f"{scheme}://***@{host.rsplit('@', 1)[1]}{sep}{path}"
    if len(output) > _SHOWN_CHARS:
        output = output[:_SHOWN_CHARS] + "..."
    return repr(output)
