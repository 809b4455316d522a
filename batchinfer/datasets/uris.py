"""Locations to pyarrow file systems, file systems back to locations, and store failures in one sentence.

A location is a local path (relative ones are made absolute), a ``file://`` URI or an object store
URI (``s3://bucket/key``, ``gs://bucket/key``, ``hdfs://``, ``abfs://``: whatever pyarrow's file
systems open). ``s3://`` reads the standard AWS environment, as boto3 and the AWS CLI do, so any
S3-compatible store (MinIO, Ceph, R2, moto) works unchanged:

- ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``: the endpoint (``http://minio:9000``);
- ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN`` (or a profile, or the
  instance's role): the credentials, through the AWS SDK's own chain;
- ``AWS_REGION`` / ``AWS_DEFAULT_REGION``: the region (looked up from the bucket when neither is set
  and the endpoint is AWS's own);
- ``AWS_MAX_ATTEMPTS``: attempts per request (default 3), as boto3 reads it.

These are the AWS SDKs' variables, not batchinfer's: :mod:`batchinfer.config` reads ``BATCHINFER_*``
only, and pyarrow's own ``S3FileSystem()`` does not read the endpoint variables, hence this module.
"""

from __future__ import annotations

import contextlib
import os
import re
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_DEFAULT_ATTEMPTS = 3
# pyarrow's file system type names -> the URI scheme users write
_SCHEMES = {"s3": "s3", "gcs": "gs", "hdfs": "hdfs", "abfs": "abfs"}


def is_uri(location: str) -> bool:
    """Whether ``location`` is a ``scheme://`` URI rather than a local path."""
    return _URI.match(location) is not None


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def _s3(uri: str) -> tuple[pafs.FileSystem, str]:
    parts = urlsplit(uri)
    if not parts.netloc:
        raise ValueError(f"{uri} names no bucket (s3://BUCKET/KEY)")
    path = f"{parts.netloc}/{parts.path.strip('/')}".rstrip("/")
    options: dict = {}
    endpoint = _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    if endpoint:
        scheme, _, rest = endpoint.partition("://")
        if rest:
            options["scheme"], endpoint = scheme, rest
        options["endpoint_override"] = endpoint.rstrip("/")
    region = _env("AWS_REGION", "AWS_DEFAULT_REGION")
    if region:
        options["region"] = region
    elif not endpoint:
        # AWS itself: the bucket's region, as FileSystem.from_uri does; on failure the first real
        # access reports the problem in its own words
        with contextlib.suppress(OSError, ValueError):
            options["region"] = pafs.resolve_s3_region(parts.netloc)
    attempts = _env("AWS_MAX_ATTEMPTS")
    try:
        max_attempts = max(1, int(attempts)) if attempts else _DEFAULT_ATTEMPTS
    except ValueError:
        raise ValueError(f"AWS_MAX_ATTEMPTS={attempts!r} is not a whole number") from None
    options["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=max_attempts)
    return pafs.S3FileSystem(**options), path


def filesystem_for(location: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path on it) for a local path (made absolute), file://, s3://, gs://, hdfs:// ...

    s3:// honours the standard AWS environment: AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3),
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION / AWS_DEFAULT_REGION,
    so any S3-compatible store works unchanged. An s3:// URI with pyarrow's own query options
    (``?endpoint_override=...``) is opened by pyarrow as written. ValueError for an
    unsupported/invalid URI; a store that cannot be reached fails on first use (OSError), not here.
    """
    location = os.fspath(location)
    if not location:
        raise ValueError("an empty location")
    if not is_uri(location):
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(location))
    if location.lower().startswith("s3://") and "?" not in location:
        return _s3(location)
    try:
        fs, path = pafs.FileSystem.from_uri(location)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise ValueError(f"unsupported or invalid location {location}: {e}") from None
    return fs, path.rstrip("/") or path


def location_of(fs: pafs.FileSystem, path: str) -> str:
    """What errors and manifests show for ``path`` on ``fs``: ``s3://bucket/key``, ``gs://...``, or
    the absolute local path."""
    if isinstance(fs, pafs.LocalFileSystem):
        return path
    scheme = _SCHEMES.get(fs.type_name, fs.type_name)
    return f"{scheme}://{path.lstrip('/') if scheme in ('s3', 'gs') else path}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def store_error(e: BaseException, location: str) -> str:
    """One clear sentence for a failed store access: endpoint unreachable, no such bucket,
    access denied / wrong credentials, no such file — naming the location.

    pyarrow reports S3 failures as OSError carrying the AWS SDK's error code (``AWS Error
    NETWORK_CONNECTION``, ``NO_SUCH_BUCKET``, ``ACCESS_DENIED``, ...); the code picks the sentence.
    """
    text = str(e)
    s3 = location.lower().startswith("s3://")
    if "NETWORK_CONNECTION" in text or "Could not connect" in text or "Could not resolve" in text:
        target = re.search(r"(?:Failed to connect to |Could not resolve host: )([^\s:;]+(?::\d+)?)", text)
        where = f" at {target.group(1)}" if target else ""
        hint = " (check AWS_ENDPOINT_URL and the network)" if s3 else ""
        return f"cannot reach the object store{where} holding {location}{hint}"
    if "NO_SUCH_BUCKET" in text or "NoSuchBucket" in text or "bucket does not exist" in text:
        bucket = urlsplit(location).netloc if is_uri(location) else ""
        return f"no such bucket {bucket!r}: {location} cannot be read" if bucket else \
            f"no such bucket: {location} cannot be read"
    if "INVALID_ACCESS_KEY_ID" in text or "InvalidAccessKeyId" in text:
        return (f"access to {location} denied: the store does not know this access key "
                "(check AWS_ACCESS_KEY_ID)")
    if "SIGNATURE_DOES_NOT_MATCH" in text or "SignatureDoesNotMatch" in text:
        return (f"access to {location} denied: the secret key does not match the access key "
                "(check AWS_SECRET_ACCESS_KEY)")
    if "EXPIRED_TOKEN" in text or "ExpiredToken" in text:
        return f"access to {location} denied: the credentials have expired (renew AWS_SESSION_TOKEN)"
    if ("ACCESS_DENIED" in text or "AccessDenied" in text or "Forbidden" in text
            or isinstance(e, PermissionError)):
        hint = (": wrong credentials or no permission (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                "and the bucket's policy)") if s3 else ": permission denied"
        return f"access to {location} denied{hint}"
    if isinstance(e, FileNotFoundError) or "Path does not exist" in text or "NoSuchKey" in text:
        return f"{location} does not exist"
    return f"cannot read {location}: {_first_line(e)}"
